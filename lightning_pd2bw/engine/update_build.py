"""The update's parts chosen once, from the run, for one stage: ``build_update`` (``update.py`` describes each).
A new feature of the update is one part and one line here."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .build import TiedParameter
from .delay_correction import ErrorFeedback
from .grad_buckets import GradientBuckets, release
from .gradient_store import GradientStore
from .layout import Mode
from .ledger import BatchLedger
from .options import PipelineOptions
from .sharding import OptimizerShards
from .stepper import Stepper
from .update import UpdatePart, UpdateRule
from .update_parts import (
    BeforeStepHooks,
    BucketReducer,
    ClipByValue,
    GlobalNormClip,
    SkipNonFinite,
    StageNorm,
    StageNormClip,
    StopOnNonFinite,
    TiedSums,
)
from .versions import WeightVersions


def build_update(
    options: PipelineOptions,
    optimizers: Sequence[torch.optim.Optimizer],
    params: Sequence[nn.Parameter],
    shared: Sequence[TiedParameter],
    groups: Any,
    width: int,
    device: torch.device,
    ledger: BatchLedger,
    versions: WeightVersions,
    *,
    shards: OptimizerShards | None = None,
    correction: ErrorFeedback | None = None,
    clip_val: float | None = None,
    clip_algorithm: str = "norm",
    before_step: Callable[[torch.optim.Optimizer], None] | None = None,
    names: Callable[[], dict[int, list[str]]] = dict,
    describe: Callable[[], str] = lambda: "this rank",
    info: Callable[[str], None] = print,
) -> UpdateRule:
    """One stage's ``UpdateRule`` over the parts its run needs (``groups``: ``grid.Groups``; ``width``: replicas)."""
    params = list(params)
    double_buffered = Mode(options.mode).double_buffered
    tied = {id(s.param) for s in shared}
    release(params)  # a previous engine's buckets over these parameters
    buckets = None
    if (width > 1 or versions.mixed) and optimizers:  # mixed: the buckets keep float32 main gradients
        replicated = [p for p in params if id(p) not in tied]
        owners = shards if options.shard_gradients else None  # each owner's gradients reduced to it
        buckets = GradientBuckets(replicated, groups.replica, width, shards=owners)
    sharded = buckets is not None and buckets.sharded
    parts: list[UpdatePart] = []
    if buckets is not None:
        parts.append(BucketReducer(buckets, params, double_buffered))
    if shared:
        parts.append(TiedSums(shared, params, groups.replica, width))
    if options.on_nonfinite == "stop":
        parts.append(StopOnNonFinite(ledger, names, describe, options.keys))
    else:
        parts.append(SkipNonFinite(ledger, groups, device, sharded, info))
    if before_step is not None:
        parts.append(BeforeStepHooks(ledger, optimizers, before_step))
    if clip_val:
        if clip_algorithm == "value":
            parts.append(ClipByValue(ledger, clip_val))
        else:
            norm = StageNorm(params, shared, device, groups.shard if sharded else None)
            if options.clip_mode == "global":
                parts.append(GlobalNormClip(ledger, norm, groups.pipeline, clip_val))
            else:
                parts.append(StageNormClip(ledger, norm, clip_val))
    parts.append(Stepper(optimizers, ledger, versions, correction if double_buffered else None, shards))
    store = GradientStore(params, tied, buckets, versions.mixed)
    return UpdateRule(params, versions, store, parts, double_buffered)
