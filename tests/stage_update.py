"""The update's handlers for one stage driven alone by a test (one process, no collectives): what the engine's
``UpdateRule`` does, minus everything between processes."""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_pd2bw.engine.schedules import schedule as S
from lightning_pd2bw.engine.state.versions import WeightVersions


def local_update(versions: WeightVersions, step_fn: Callable[[int], None]) -> dict[S.Kind, Callable[[S.Action], None]]:
    """The update's handlers for a stage driven alone (one process, no collectives: unit tests, measurements): an
    update begins at REDUCE (the next weight version made writable, the batch's gradients set aside), and at STEP
    ``step_fn(batch)`` runs on the newest weights with that batch's gradients in ``.grad`` (the next batch's,
    accumulated meanwhile, back afterwards); the other parts, PUBLISH and LOSS do nothing.
    ``StageExecutor(..., versions, ..., handlers=local_update(versions, step_fn))``."""
    params = versions.parameters
    aside: dict[int, list[torch.Tensor | None]] = {}

    def begin(action: S.Action) -> None:
        versions.begin_update()
        aside[action.batch] = [p.grad for p in params]
        for p in params:
            p.grad = None

    def step(action: S.Action) -> None:
        versions.use_latest()
        current = [p.grad for p in params]
        for p, grad in zip(params, aside.pop(action.batch)):
            p.grad = grad
        step_fn(action.batch)
        for p, grad in zip(params, current):
            p.grad = grad

    def nothing(action: S.Action) -> None:
        pass

    return {
        S.REDUCE: begin,
        S.CHECK: nothing,
        S.HOOKS: nothing,
        S.NORM: nothing,
        S.CLIP: nothing,
        S.STEP: step,
        S.PUBLISH: nothing,
        S.LOSS: nothing,
    }
