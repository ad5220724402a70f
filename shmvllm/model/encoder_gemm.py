"""Which GEMM the encoders' linears run on the CPU, and the AVX2 one (kernels/encoder_gemm.c).

On CPUs with AVX-512, oneDNN's fused linears (model/bert.py's `_linear`) are the fastest of what
was measured; capped to AVX2 they lose 15-21% at MiniLM's shapes, while the C kernel here runs
9-45% ahead of them per GEMM and the whole encoder 16% faster (benchmarks/results/embed.md,
"The AVX2 GEMM"). So the encoders use the C
kernel where AVX2 + FMA is the best vector ISA: CPUs without AVX-512, or ``SHMVLLM_QUANT_ISA=avx2``
(the knob that already holds shmvllm's kernels to AVX2).
"""

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

    def __call__(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, gelu: Optional[str] = None) -> torch.Tensor:
        """x @ W^T + b, then + residual, or GELU ("none": erf form, "tanh"; None: no GELU)."""
        if x.dim() != 2 or x.shape[1] != self.in_features or x.dtype != torch.float32:
            raise ValueError(f"x must be a float32 [tokens, {self.in_features}] tensor, got {x.dtype} {tuple(x.shape)}.")
        if x.stride(1) != 1:
            x = x.contiguous()
        out = x.new_empty(x.shape[0], self.out_features)
        if residual is not None and (residual.shape != out.shape or residual.stride(1) != 1):
            raise ValueError(f"residual must be a row-major {tuple(out.shape)} tensor, got {tuple(residual.shape)}.")
        self._lib.shm_encoder_gemm(
            x.data_ptr(), x.shape[0], self.in_features, x.stride(0), self.packed.data_ptr(), self.out_features,
            None if residual is None else residual.data_ptr(), 0 if residual is None else residual.stride(0),
            out.data_ptr(), out.stride(0), GELU_CODES[gelu],
        )
        return out


def pack_for_cpu(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> Optional[PackedLinear]:
    """The AVX2 kernel's packed linear when it is the one to use for these tensors (fp32 on a CPU
    whose best ISA is AVX2, the kernel built); None: keep to oneDNN / torch."""
    from shmvllm.model.kernels import encoder_gemm_kernels, quant_isa

    # the build the quantized kernels run: "avx2" without AVX-512, or held there by SHMVLLM_QUANT_ISA
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or quant_isa() != "avx2":
        return None
    if encoder_gemm_kernels() is None:
        return None
    return PackedLinear(weight, bias)
