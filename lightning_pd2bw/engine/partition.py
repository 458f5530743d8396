"""Layer list -> contiguous stages balanced by cost; parameters shared across stages.

Balancing minimises the largest stage cost (the pipeline's slowest stage sets its pace) by dynamic
programming over prefix sums. The cost of a layer defaults to its parameter count, measured on
whatever device the layer lives on (the meta device included).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn


def layer_parameter_counts(layers: Sequence[nn.Module]) -> list[int]:
    return [sum(p.numel() for p in layer.parameters()) for layer in layers]


def balanced_partition(costs: Sequence[float], num_stages: int) -> list[range]:
    """Split ``costs`` into ``num_stages`` contiguous, non-empty ranges minimising the largest sum.

    Ties keep the earliest cut for each stage boundary, so equal costs split evenly and any
    remainder lands on the later stages, which stash fewer microbatches under 1F1B.
    """
    n = len(costs)
    if num_stages < 1:
        raise ValueError(f"num_stages={num_stages} must be >= 1")
    if num_stages > n:
        raise ValueError(
            f"num_stages={num_stages} exceeds the model's {n} pipeline layers: every stage needs at least "
            f"one layer; use num_stages <= {n}"
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[s][i]: minimal max-cost splitting the first i layers into s stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:  # strict: ties keep the earliest cut
                    best[s][i] = value
                    cut[s][i] = j
    bounds = [n]
    for s in range(num_stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    bounds.reverse()
    return [range(bounds[i], bounds[i + 1]) for i in range(num_stages)]


@dataclass(frozen=True)
class SharedParameter:
    """A parameter held by layers of several stages (e.g. GPT's tied embedding).

    ``locations[i]`` is ``(layer index, parameter name)`` of its first occurrence on ``stages[i]``,
    recorded before partitioning, so each stage finds its own handle after materialisation.
    """

    stages: tuple[int, ...]
    locations: tuple[tuple[int, str], ...]

    def location_on(self, stage: int) -> tuple[int, str]:
        return self.locations[self.stages.index(stage)]


def shared_parameters(layers: Sequence[nn.Module], stage_ranges: Sequence[range]) -> list[SharedParameter]:
    """Parameters (by identity) that appear in more than one stage, in a deterministic order."""
    found: dict[int, dict[int, tuple[int, str]]] = {}
    for stage, layer_range in enumerate(stage_ranges):
        for index in layer_range:
            for name, param in layers[index].named_parameters(remove_duplicate=False):
                found.setdefault(id(param), {}).setdefault(stage, (index, name))
    return [
        SharedParameter(tuple(sorted(where)), tuple(where[s] for s in sorted(where)))
        for where in found.values()
        if len(where) > 1
    ]
