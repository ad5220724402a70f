"""vLLM's `current_platform` (`vllm.platforms`): what programs ask about the device they run on.

shmvllm runs on the CPU, or on CUDA when torch sees a device; never ROCm, XPU or TPU.
"""

from __future__ import annotations

import functools


class Platform:
    """The device shmvllm's engine would pick by default (EngineArgs(device="auto"))."""

    @functools.cached_property
    def device_type(self) -> str:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def device_name(self) -> str:
        return self.device_type

    def get_device_name(self, device_id: int = 0) -> str:
        if self.device_type == "cuda":
            import torch

            return torch.cuda.get_device_name(device_id)
        import platform

        return platform.processor() or platform.machine()

    def is_cpu(self) -> bool:
        return self.device_type == "cpu"

    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    def is_cuda_alike(self) -> bool:
        return self.is_cuda()

    def is_rocm(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def is_tpu(self) -> bool:
        return False

    def is_out_of_tree(self) -> bool:
        return False


current_platform = Platform()

__all__ = ["Platform", "current_platform"]
