"""The pipeline's layout: mode, depth, microbatches and the stage cut, validated once.

``Layout`` is what the engine is built for; the strategy and the Hydra config checks phrase their own keys
around the same rules (``schedule.validate``, ``grid.check_world_size``, ``ranges_of``). The width (data-parallel
replicas) follows from the world size: ``world = num_stages x width``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from . import schedule
from .grid import ProcessGrid
from .partition import balanced_partition, layer_parameter_counts


def ranges_of(layers_per_stage: Sequence[int], num_layers: int) -> list[range]:
    """``[2, 3]`` over 5 layers -> ``[range(0, 2), range(2, 5)]``, or a clear error."""
    if sum(layers_per_stage) != num_layers or min(layers_per_stage) < 1:
        raise ValueError(
            f"layers_per_stage={list(layers_per_stage)} must be positive and sum to the model's {num_layers} "
            "pipeline layers"
        )
    bounds = [0]
    for count in layers_per_stage:
        bounds.append(bounds[-1] + count)
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


@dataclass(frozen=True)
class Layout:
    """``num_stages`` (d), ``num_microbatches`` (m, default d; m >= d), ``mode`` (``"2bw"``, ``"flush"``,
    ``"gpipe"``) and optionally ``layers_per_stage`` (the cut; default: balanced by parameter count)."""

    num_stages: int
    num_microbatches: int | None = None
    mode: str = "2bw"
    layers_per_stage: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.num_microbatches is None:
            object.__setattr__(self, "num_microbatches", self.num_stages)
        schedule.validate(self.mode, self.num_stages, self.num_microbatches)
        if self.layers_per_stage is not None:
            object.__setattr__(self, "layers_per_stage", tuple(self.layers_per_stage))
            if len(self.layers_per_stage) != self.num_stages:
                raise ValueError(
                    f"layers_per_stage={list(self.layers_per_stage)} needs one entry per stage "
                    f"(num_stages={self.num_stages})"
                )

    def cut(self, layers: Sequence[nn.Module]) -> list[range]:
        """Each stage's range of layer indices."""
        if self.layers_per_stage is not None:
            return ranges_of(self.layers_per_stage, len(layers))
        return balanced_partition(layer_parameter_counts(layers), self.num_stages)

    def grid(self, rank: int, world_size: int) -> ProcessGrid:
        """The process grid of ``world_size`` ranks (an error names the world sizes that fit)."""
        return ProcessGrid(rank, world_size, self.num_stages)
