"""The update's parts chosen once, from the run, for one stage: ``choose_parts`` picks them from the stage's
``UpdateShape``, ``build_update`` builds them (``update.py`` describes each). A new feature of the update is one part,
one line in ``choose_parts`` and one in ``build_update``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..layout import Mode
from ..state.ledger import BatchLedger
from ..state.versions import WeightVersions
from .collectives import Collective
from .delay_correction import ErrorFeedback
from .grad_buckets import GradientBuckets, release
from .gradient_store import GradientStore
from .sharding import OptimizerShards
from .stepper import Stepper
from .update import ClipKind, NonFinite, TiedParameter, UpdatePart, UpdateRule, UpdateShape
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

if TYPE_CHECKING:  # the run's options read here; options.py reads the delay correction's methods from updates
    from ..options import PipelineOptions


def choose_parts(shape: UpdateShape) -> list[type[UpdatePart]]:
    """The parts of a stage's update of ``shape``, in the order their handlers run (one line per feature)."""
    parts: list[type[UpdatePart]] = []
    if shape.buckets:
        parts.append(BucketReducer)
    if shape.tied:
        parts.append(TiedSums)
    parts.append(StopOnNonFinite if shape.nonfinite is NonFinite.STOP else SkipNonFinite)
    if shape.hooks:
        parts.append(BeforeStepHooks)
    clippers = {ClipKind.VALUE: ClipByValue, ClipKind.GLOBAL: GlobalNormClip, ClipKind.STAGE: StageNormClip}
    if shape.clip is not None:
        parts.append(clippers[shape.clip])
    parts.append(Stepper)
    return parts


def collectives(shape: UpdateShape) -> list[tuple[type[UpdatePart], list[Collective]]]:
    """Each part of ``shape``'s update with the collectives it declares (what ``verify/comm_plan.py`` lowers)."""
    return [(part, part.collectives(shape)) for part in choose_parts(shape)]


@dataclass(frozen=True)
class StageContext:
    """What building a stage's update reads of the stage (``PipelineEngine.start`` makes it once): the run's options,
    the stage's parameters (a tied one once) and its tied ones, its groups (``grid.Groups``), its replicas, its
    device and ledger; ``names``, ``describe`` and ``info`` word messages."""

    options: PipelineOptions
    params: Sequence[nn.Parameter]
    shared: Sequence[TiedParameter]
    groups: Any
    width: int
    device: torch.device
    ledger: BatchLedger
    names: Callable[[], dict[int, list[str]]] = dict
    describe: Callable[[], str] = lambda: "this rank"
    info: Callable[[str], None] = print


def build_update(
    stage: StageContext,
    optimizers: Sequence[torch.optim.Optimizer],
    versions: WeightVersions,
    *,
    shards: OptimizerShards | None = None,
    correction: ErrorFeedback | None = None,
    before_step: Callable[[torch.optim.Optimizer], None] | None = None,
) -> UpdateRule:
    """One stage's ``UpdateRule`` over the parts its run needs."""
    options, ledger, groups, width = stage.options, stage.ledger, stage.groups, stage.width
    params, shared = list(stage.params), stage.shared
    double_buffered = Mode(options.mode).double_buffered
    tied = {id(s.param) for s in shared}
    release(params)  # a previous engine's buckets over these parameters
    buckets = None
    if (width > 1 or versions.mixed) and optimizers:  # mixed: the buckets keep float32 main gradients
        replicated = [p for p in params if id(p) not in tied]
        owners = shards if options.gradients_to_owners else None  # each owner's gradients reduced to it
        main = torch.float32 if versions.mixed else None  # mixed: float32 main gradients, on every replica alike
        reduce_dtype = options.grad_reduce_dtype  # the sums over the replicas: float32, or bfloat16 on a cast copy
        buckets = GradientBuckets(
            replicated, groups.replica, width, shards=owners, dtype=main, reduce_dtype=reduce_dtype
        )
    clip_val = options.clipping.value
    shape = UpdateShape.of(
        options.mode,
        width,
        shard_optimizer=shards is not None,  # the optimizer sharded here (options.shard_optimizer, width > 1)
        shard_gradients=options.gradients_to_owners and buckets is not None,
        nonfinite=options.on_nonfinite,
        clip=options.clipping.kind,
        buckets=0 if buckets is None else buckets.num_buckets,
        tied=bool(shared),
        hooks=before_step is not None,
    )
    sharded = shape.sharded
    assert sharded == (buckets is not None and buckets.sharded), "the buckets reduce to owners iff the shape says"
    norm = StageNorm(params, shared, stage.device, groups.shard if sharded else None)

    def reducer() -> UpdatePart:
        assert buckets is not None  # choose_parts picks the reducer only with buckets (shape.buckets > 0)
        return BucketReducer(buckets, params, double_buffered)

    def hooks() -> UpdatePart:
        assert before_step is not None  # chosen only with hooks (shape.hooks)
        return BeforeStepHooks(ledger, optimizers, before_step)

    def clip_value() -> float:
        assert clip_val is not None  # a clipper is chosen only with a value (Clipping.kind)
        return clip_val

    build: dict[type[UpdatePart], Callable[[], UpdatePart]] = {
        BucketReducer: reducer,
        TiedSums: lambda: TiedSums(shared, params, groups.replica, width),
        StopOnNonFinite: lambda: StopOnNonFinite(ledger, stage.names, stage.describe, options.keys),
        SkipNonFinite: lambda: SkipNonFinite(ledger, groups, stage.device, sharded, stage.info),
        BeforeStepHooks: hooks,
        ClipByValue: lambda: ClipByValue(ledger, clip_value()),
        GlobalNormClip: lambda: GlobalNormClip(ledger, norm, groups.pipeline, clip_value()),
        StageNormClip: lambda: StageNormClip(ledger, norm, clip_value()),
        Stepper: lambda: Stepper(optimizers, ledger, versions, correction if double_buffered else None, shards),
    }
    parts = [build[kind]() for kind in choose_parts(shape)]
    store = GradientStore(params, tied, buckets, versions.mixed)
    return UpdateRule(params, versions, store, parts, double_buffered, declared=collectives(shape))
