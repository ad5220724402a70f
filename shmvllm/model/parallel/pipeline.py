"""Pipeline parallelism's split: which decoder layers a stage holds, and whether it holds the
embedding (the first stage) and the final norm + lm_head (the last). Torch-free, so the engine
can say what each stage holds without loading the model."""

from __future__ import annotations

from dataclasses import dataclass

from shmvllm.model.parallel.split import split_range


@dataclass(frozen=True)
class PipelineStage:
    """Stage `index` of `size`: layers [start, stop) of a model of num_layers (stop None: all)."""

    index: int = 0
    size: int = 1
    start: int = 0
    stop: int | None = None

    @classmethod
    def of(cls, num_layers: int, size: int, index: int) -> "PipelineStage":
        """The layers split as evenly as they go, the first num_layers % size stages one longer."""
        if not 0 <= index < size:
            raise ValueError(f"pipeline stage index must be in [0, {size}), got {index!r}.")
        if num_layers < size:
            raise ValueError(f"pipeline_parallel_size={size} is more than the model's num_hidden_layers={num_layers}: "
                             "every stage needs at least one layer.")
        start, stop = split_range(num_layers, size, index)
        return cls(index, size, start, stop)

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.size - 1

    @property
    def whole(self) -> bool:
        return self.size == 1

    def holds_layer(self, layer: int) -> bool:
        return self.start <= layer and (self.stop is None or layer < self.stop)
