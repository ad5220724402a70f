"""LoRARequest, vLLM's type of a LoRA adapter request (`vllm.lora.request`).

shmvllm has no LoRA: programs may build one, and pass `lora_request=None`; a real one is refused
by `LLM` with a ValueError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    long_lora_max_len: Optional[int] = None
    base_model_name: Optional[str] = None
    tensorizer_config_dict: Optional[dict] = None


def check_no_lora(lora_request: Any) -> None:
    """None, or a list of Nones, passes; anything else is refused by name."""
    requests = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request]
    if any(r is not None for r in requests):
        raise ValueError(f"lora_request={lora_request!r} is not supported: shmvllm has no LoRA adapters.")
