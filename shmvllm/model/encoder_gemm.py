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
        self,
        x: torch.Tensor,
        residual: Optional[torch.Tensor] = None,
        gelu: Optional[str] = None,
        norm: Optional[torch.nn.LayerNorm] = None,
        out: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """x @ W^T + b, then + residual, or GELU ("none": erf form, "tanh"; None: no GELU), then
        `norm` (a LayerNorm over the output features) if given; into `out` (row-major rows, not
        overlapping x or residual) if given, else a new tensor."""
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
        norm_w = norm_b = None
        if norm is not None:
            if tuple(norm.normalized_shape) != (self.out_features,) or norm.weight is None or norm.bias is None:
                raise ValueError(f"norm must be a LayerNorm over {self.out_features} features with weight and bias, got {norm}.")
            norm_w, norm_b = norm.weight.data_ptr(), norm.bias.data_ptr()
        self._lib.shm_encoder_gemm(
            x.data_ptr(), x.shape[0], self.in_features, x.stride(0), self.packed.data_ptr(), self.out_features,
            None if residual is None else residual.data_ptr(), 0 if residual is None else residual.stride(0),
            out.data_ptr(), out.stride(0), GELU_CODES[gelu], norm_w, norm_b, 0.0 if norm is None else norm.eps,
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
