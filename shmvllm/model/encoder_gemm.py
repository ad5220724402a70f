"""Which GEMM the encoders' linears run on the CPU, and the AVX2 one (kernels/encoder_gemm.c).

The C kernel runs the encoders' fp32 linears on every x86 CPU with AVX2 + FMA, AVX-512 ones
included: with its fused epilogues (bias, residual or GELU, then LayerNorm) one 4,096-token piece
of all-MiniLM-L6-v2 ran 10-12% faster than on oneDNN's fused linears on AVX-512 Zen 4, where
512-bit FMAs are double-pumped and give no more FLOPs (benchmarks/results/embed.md). oneDNN /
torch run them elsewhere, and where ``SHMVLLM_QUANT_ISA=portable`` holds shmvllm off its vector kernels."""

from __future__ import annotations

from typing import Optional

import torch

GELU_CODES = {None: 0, "none": 1, "tanh": 2}  # `_linear`'s gelu argument -> encoder_gemm.c's code


class PackedLinear:
    """An nn.Linear's fp32 weight and bias, packed for encoder_gemm.c (the packed copy sits beside
    the layer's own tensors, which other paths and state_dict() keep using)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> None:
        from shmvllm.model.kernels import encoder_gemm_kernels

        self._lib = encoder_gemm_kernels()
        self.out_features, self.in_features = weight.shape
        weight = weight.contiguous()
        bias = None if bias is None else bias.contiguous()
        self.packed = torch.empty(self._lib.shm_encoder_packed_floats(self.out_features, self.in_features))
        self._lib.shm_encoder_pack(weight.data_ptr(), None if bias is None else bias.data_ptr(),
                                   self.out_features, self.in_features, self.packed.data_ptr())

    def __call__(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, gelu: Optional[str] = None,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """x @ W^T + b, then + residual, or GELU ("none": erf form, "tanh"; None: no GELU); into
        `out` (row-major rows, not overlapping x or residual) if given, else a new tensor."""
        if x.dim() != 2 or x.shape[1] != self.in_features or x.dtype != torch.float32:
            raise ValueError(f"x must be a float32 [tokens, {self.in_features}] tensor, got {x.dtype} {tuple(x.shape)}.")
        if x.stride(1) != 1:
            x = x.contiguous()
        shape = (x.shape[0], self.out_features)
        if out is None:
            out = x.new_empty(shape)
        elif out.shape != shape or out.stride(1) != 1 or out.dtype != torch.float32:
            raise ValueError(f"out must be a row-major float32 {shape} tensor, got {out.dtype} {tuple(out.shape)}.")
        if residual is not None and (residual.shape != shape or residual.stride(1) != 1):
            raise ValueError(f"residual must be a row-major {shape} tensor, got {tuple(residual.shape)}.")
        self._lib.shm_encoder_gemm(
            x.data_ptr(), x.shape[0], self.in_features, x.stride(0), self.packed.data_ptr(), self.out_features,
            None if residual is None else residual.data_ptr(), 0 if residual is None else residual.stride(0),
            out.data_ptr(), out.stride(0), GELU_CODES[gelu],
        )
        return out


def pack_for_cpu(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> Optional[PackedLinear]:
    """The packed linear when the kernel is the one to use for these tensors (fp32 on a CPU with
    AVX2 + FMA, the kernel built); None: keep to oneDNN / torch."""
    from shmvllm.model.kernels import encoder_gemm_kernels, quant_isa

    # quant_isa(): the best build this CPU runs, or the one SHMVLLM_QUANT_ISA holds it to; every
    # build but "portable" implies AVX2 + FMA
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or quant_isa() in (None, "portable"):
        return None
    if encoder_gemm_kernels() is None:
        return None
    return PackedLinear(weight, bias)


def token_wise(
    attn: torch.Tensor,
    x: torch.Tensor,
    attn_out: PackedLinear,
    norm1: torch.nn.LayerNorm,
    up: PackedLinear,
    gelu: str,
    down: PackedLinear,
    norm2: torch.nn.LayerNorm,
    out: torch.Tensor,
) -> torch.Tensor:
    """A post-LayerNorm layer's token-wise half in one kernel call, a block of rows at a time:
    y = norm1(attn_out(attn) + x), out = norm2(down(GELU(up(y))) + y). attn, x, out: row-major
    float32 [tokens, hidden] rows (out may be x); gelu: "none" (erf form) or "tanh"."""
    hidden, inter = attn_out.out_features, up.out_features
    shape = (attn.shape[0], hidden)
    for name, t in (("attn", attn), ("x", x), ("out", out)):
        if t.shape != shape or t.stride(1) != 1 or t.dtype != torch.float32:
            raise ValueError(f"{name} must be a row-major float32 {shape} tensor, got {t.dtype} {tuple(t.shape)}.")
    if (attn_out.in_features, up.in_features, down.in_features, down.out_features) != (hidden, hidden, inter, hidden):
        raise ValueError(f"attn_out, up and down do not chain: {attn_out.in_features}->{hidden}, {up.in_features}->{inter}, "
                         f"{down.in_features}->{down.out_features}.")
    for name, norm in (("norm1", norm1), ("norm2", norm2)):
        if tuple(norm.normalized_shape) != (hidden,) or norm.weight is None or norm.bias is None or norm.eps != norm1.eps:
            raise ValueError(f"{name} must be a LayerNorm over {hidden} features with weight, bias and norm1's eps, got {norm}.")
    if attn_out._lib.shm_encoder_token_wise(
        attn.data_ptr(), attn.stride(0), x.data_ptr(), x.stride(0), shape[0], hidden, inter, attn_out.packed.data_ptr(),
        norm1.weight.data_ptr(), norm1.bias.data_ptr(), up.packed.data_ptr(), GELU_CODES[gelu], down.packed.data_ptr(),
        norm2.weight.data_ptr(), norm2.bias.data_ptr(), norm1.eps, out.data_ptr(), out.stride(0),
    ):
        raise MemoryError("encoder token-wise kernel: out of memory for its per-thread buffers.")
    return out
