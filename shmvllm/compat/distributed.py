"""vLLM's `vllm.distributed` names that offline programs call between two LLMs."""

from __future__ import annotations

import gc


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """Frees what a deleted LLM left: shmvllm keeps no process group in the frontend (each engine
    tears its own down when it exits), so this collects garbage (which closes an unreferenced
    LLM's engine) and empties CUDA's cache where torch has one. shutdown_ray: ray.shutdown()."""
    gc.collect()
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
    if shutdown_ray:
        ray = sys.modules.get("ray")
        if ray is not None:
            ray.shutdown()


__all__ = ["cleanup_dist_env_and_memory"]
