"""How n items (KV heads, intermediate rows, vocabulary rows) split over the ranks: contiguous
parts, the first n % world_size one item longer. Torch-free, so the engine can say what each
rank holds without loading the model."""

from __future__ import annotations


def split_range(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rank's [start, stop) of n items split into world_size contiguous parts, the first
    n % world_size parts one item longer."""
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def split_sizes(n: int, world_size: int) -> list[int]:
    return [stop - start for start, stop in (split_range(n, world_size, r) for r in range(world_size))]


def split_in_units(n: int, unit: int, world_size: int, rank: int) -> tuple[int, int]:
    """split_range in whole units of `unit` items where n has at least one per rank, else split_range."""
    if unit > 1 and n % unit == 0 and n // unit >= world_size:
        start, stop = split_range(n // unit, world_size, rank)
        return start * unit, stop * unit
    return split_range(n, world_size, rank)
