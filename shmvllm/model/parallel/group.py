"""The tensor-parallel group of one engine: its rank, its size, and the collectives the
sharded layers need, over torch.distributed's gloo backend (CPU tensors, TCP on loopback).

The layers' all-reduces (twice per layer, small: [tokens, hidden]) go through a shared-memory
arena (`ipc.arena`) by default: each rank copies its partial sum into its slot, publishes, waits
for the others, and adds all slots in rank order (so every rank holds the same bits).
`SHMVLLM_TP_ALLREDUCE=gloo` (or a machine where the arena's C helper does not build) sends them
through gloo instead; benchmarks/tensor_parallel.py runs both. Tensors larger than a slot, and
the logits' gather, always use gloo.
"""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from shmvllm import envs

if TYPE_CHECKING:
    from ipc.arena import Arena

DEFAULT_TIMEOUT_S = 60.0


def use_arena() -> bool:
    """Whether the all-reduces go through the shared-memory arena (the default, and
    SHMVLLM_TP_ALLREDUCE=shm, where the C helper builds) or gloo (SHMVLLM_TP_ALLREDUCE=gloo)."""
    from ipc.arena import arena_available

    value = envs.SHMVLLM_TP_ALLREDUCE()
    if value not in ("gloo", "shm"):
        raise ValueError(f"SHMVLLM_TP_ALLREDUCE must be 'gloo' or 'shm', got {value!r}")
    return value == "shm" and arena_available()


class TPGroup:
    """One rank's handle on the group. Collectives run in the order every rank calls them."""

    def __init__(self, rank: int, world_size: int, arena: Optional["Arena"] = None) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.rank, self.world_size = rank, world_size
        self.arena = arena
        self._seq = 0
        if arena is not None:
            self._slots = [
                [torch.frombuffer(arena.slot(parity, i), dtype=torch.float32) for i in range(world_size)]
                for parity in (0, 1)
            ]

    @classmethod
    def join(
        cls, store: dist.Store, rank: int, world_size: int, arena: Optional["Arena"] = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> "TPGroup":
        """Initializes torch.distributed's default group through `store` (every rank calls this)."""
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
        )
        return cls(rank, world_size, arena)

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` over the ranks, in place; returns it."""
        arena = self.arena
        n = tensor.numel()
        if (arena is None or tensor.dtype != torch.float32 or not tensor.is_contiguous()
                or tensor.device.type != "cpu" or 4 * n > arena.slot_bytes):
            dist.all_reduce(tensor)
            return tensor
        self._seq += 1
        slots = self._slots[self._seq & 1]
        flat = tensor.view(-1)
        slots[self.rank][:n].copy_(flat)
        arena.publish(self._seq)
        arena.wait_all(self._seq, DEFAULT_TIMEOUT_S)
        flat.copy_(slots[0][:n])
        for slot in slots[1:]:
            flat.add_(slot[:n])
        return tensor

    def all_reduce_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def all_gather_columns(self, local: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """[rows, sizes[rank]] on each rank -> [rows, sum(sizes)] on every rank (shards padded
        to the largest, as the collective needs equal sizes)."""
        width = max(sizes)
        if local.shape[-1] < width:
            local = torch.nn.functional.pad(local, (0, width - local.shape[-1]))
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local.contiguous())
        return torch.cat([part[..., :size] for part, size in zip(parts, sizes)], dim=-1)

    @staticmethod
    def destroy() -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
