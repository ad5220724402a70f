"""The tensor-parallel group of one engine: its rank, its size, and the collectives the
sharded layers need, over torch.distributed's gloo backend (CPU tensors, TCP on loopback)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 60.0


class TPGroup:
    """One rank's handle on the group. Collectives run in the order every rank calls them."""

    def __init__(self, rank: int, world_size: int) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.rank, self.world_size = rank, world_size

    @classmethod
    def join(cls, store: dist.Store, rank: int, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> "TPGroup":
        """Initializes torch.distributed's default group through `store` (every rank calls this)."""
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
        )
        return cls(rank, world_size)

    def all_reduce_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` over the ranks, in place; returns it."""
        dist.all_reduce(tensor)
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
