"""How an overall density is spread over the layers (pure functions of shapes, plus a global threshold).

- ``uniform``: every layer gets the overall density.
- ``erk``: Erdős–Rényi-Kernel (Evci et al. 2020): a layer's density is proportional to
  ``sum(shape) / prod(shape)`` so small layers stay denser; layers that would exceed 1 become dense
  and the rest is rescaled until the overall density is met exactly.
- ``global``: one magnitude threshold over all targeted weights of the whole model (across pipeline
  stages), with a floor so no layer collapses to all-zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch

ALLOCATIONS = ("uniform", "erk", "global")


def keep_count(numel: int, density: float) -> int:
    """Weights kept in a layer of ``numel`` entries at ``density`` (at least one)."""
    return max(1, min(numel, round(density * numel)))


def uniform_densities(shapes: Mapping[str, Sequence[int]], density: float) -> dict[str, float]:
    return {name: density for name in shapes}


def erk_densities(shapes: Mapping[str, Sequence[int]], density: float) -> dict[str, float]:
    """ERK densities whose parameter-weighted mean is ``density``."""
    numels = {name: math.prod(shape) for name, shape in shapes.items()}
    scores = {name: sum(shape) / numels[name] for name, shape in shapes.items()}
    total = sum(numels.values())
    dense: set[str] = set()
    while True:
        budget = density * total - sum(numels[n] for n in dense)
        weighted = sum(scores[n] * numels[n] for n in shapes if n not in dense)
        epsilon = budget / weighted if weighted else 0.0
        over = {n for n in shapes if n not in dense and epsilon * scores[n] > 1.0}
        if not over:
            break
        dense |= over
    return {n: 1.0 if n in dense else epsilon * scores[n] for n in shapes}


def layer_densities(allocation: str, shapes: Mapping[str, Sequence[int]], density: float) -> dict[str, float]:
    if allocation == "uniform" or allocation == "global":  # global: the target, realised by one threshold
        return uniform_densities(shapes, density)
    if allocation == "erk":
        return erk_densities(shapes, density)
    raise ValueError(f"sparsity allocation={allocation!r} is not valid; valid: {', '.join(ALLOCATIONS)}")


def _as_ordered_int(value: torch.Tensor) -> torch.Tensor:
    """Non-negative float32 -> int32 with the same order (IEEE-754 bit patterns)."""
    return value.float().contiguous().view(torch.int32)


def global_threshold(
    scores: Sequence[torch.Tensor],
    keep: int,
    all_reduce: Callable[[torch.Tensor], None] | None = None,
    device: torch.device | str = "cpu",
) -> float:
    """The largest ``v`` with ``#{score >= v} >= keep`` over ``scores`` on every stage.

    A bisection over float32 bit patterns (31 rounds, one all-reduced count each), so the value is
    exact and identical on every stage without gathering the weights. Scores must be >= 0.
    """
    low, high = 0, 0x7F800000  # 0.0 and +inf as int32 bit patterns
    keys = [_as_ordered_int(s) for s in scores]
    while low < high:
        mid = (low + high + 1) // 2
        count = torch.zeros((), dtype=torch.int64, device=device)
        for key in keys:
            count += (key >= mid).sum()
        if all_reduce is not None:
            all_reduce(count)
        if count.item() >= keep:
            low = mid
        else:
            high = mid - 1
    return torch.tensor(low, dtype=torch.int32).view(torch.float32).item()
