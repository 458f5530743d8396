"""What the planner's simulator (``simulate.py``) is given per stage, ``StageCosts``, and what it returns, ``Timing``;
``rank_costs``: a rank's, over its chunks under interleaved 1F1B."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from ..engine.layout import Layout
from ..engine.updates.update import UpdateShape


@dataclass(frozen=True)
class StageCosts:
    """Seconds of one stage's work: per microbatch its forward, its backward (with any recomputation) and one
    boundary message to the next stage (latency + bytes / link; the gradient back is as large); per update the
    optimizer's step and one read of the gradients (the norm, the non-finite flags); ``shape``: its update; the
    host's work per action and per step (0 for the planner, which plans devices; measured where a run is replayed:
    ``benchmarks/simulator_check.py``)."""

    forward: float
    backward: float
    send: float = 0.0
    step: float = 0.0
    read_gradients: float = 0.0
    shape: UpdateShape = UpdateShape(double_buffered=True)
    dispatch: float = 0.0  # the host's work per action (the executor's dispatch, a kernel launch's share)
    per_step: float = 0.0  # the host's work between two steps (the training loop's, outside the actions)
    weight_grad: float = 0.0  # of ``backward``, the weight gradients a split backward defers to W (``zb_h1``)


@dataclass(frozen=True)
class Timing:
    step_time: float  # seconds per training step, steady state, the slowest stage's
    exposed: tuple[float, ...]  # per stage: seconds per step blocked on the update's collectives
    busy: tuple[float, ...]  # per stage: seconds per step of compute


def rank_costs(costs: Sequence[StageCosts], layout: Layout, rank: int) -> StageCosts:
    """A rank's costs: its stage's, or under interleaved 1F1B (``costs`` per virtual stage, ``d x V``) its chunks'
    summed, the update's shape the first chunk's (the caller gives it the rank's)."""
    if layout.virtual_stages == 1:
        return costs[rank]
    chunks = costs[rank :: layout.num_stages]
    total = lambda name: sum(getattr(c, name) for c in chunks)  # noqa: E731
    fields = ("forward", "backward", "step", "read_gradients", "weight_grad")
    return dataclasses.replace(chunks[0], **{name: total(name) for name in fields})
