"""What one stage holds now, by owner, in bytes (and the peaks since the engine started): the terms the planner's
stage memory predicts (``planner.cost.stage_memory``), read from the running stage. None of them grows with the
number of microbatches; the stash grows with depth (``d - r + lookahead`` microbatches). ``engine.counters()``."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from .compiled import CompileMeter
from .executor import StageExecutor
from .updates.delay_correction import ErrorFeedback
from .updates.update import UpdateRule


def nbytes(tensors: Iterable[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def stage_counters(
    executor: StageExecutor,
    update: UpdateRule,
    correction: ErrorFeedback | None,
    params: Sequence[nn.Parameter],
    optimizers: Sequence[torch.optim.Optimizer],
    compile_meter: CompileMeter | None = None,
) -> dict[str, int]:
    link, versions, deferred = executor.link, executor.versions, executor.weight_grads
    state = [v for o in optimizers for s in o.state.values() for v in s.values()]
    return {
        "weight_bytes": nbytes(p.data for p in params),
        "weight_versions": versions.num_versions,
        "max_weight_versions": versions.max_versions_held,
        "versions_bytes": versions.held_bytes,
        "master_bytes": versions.master_bytes,  # mixed: the float32 masters kept here (sharded: the owned ones)
        "gradient_bytes": nbytes(p.grad for p in params if p.grad is not None),
        # the replica buckets that the gradients accumulate in (width > 1, or mixed-precision weights): every set
        "gradient_buffer_bytes": update.store.held_bytes,
        # 2BW: batch b's gradients set aside from its REDUCE to its STEP, while batch b + 1 accumulates its own
        "pending_gradient_bytes": update.pending_bytes,
        "peak_pending_gradient_bytes": update.peak_pending_bytes,
        "optimizer_state_bytes": nbytes(state),
        "correction_bytes": correction.held_bytes if correction is not None else 0,
        "recomputed_layers": executor.recomputed,  # this stage's first layers that keep only their input
        "stashed_microbatches": executor.stashed_microbatches,
        "max_stashed_microbatches": executor.max_stashed,
        "stash_bytes": executor.stash_bytes,
        "peak_stash_bytes": executor.peak_stash_bytes,
        # a split backward (zb_h1): the linear maps' inputs and output gradients kept from each B to its W
        "deferred_weight_grad_bytes": deferred.pending_bytes if deferred is not None else 0,
        "peak_deferred_weight_grad_bytes": deferred.peak_bytes if deferred is not None else 0,
        "transport_bytes": link.held_bytes,
        "peak_transport_bytes": link.peak_held_bytes,
        "pending_sends": link.pending_sends,
        "peak_pending_sends": link.peak_pending_sends,
    } | (compile_meter.counters() if compile_meter is not None else {})
