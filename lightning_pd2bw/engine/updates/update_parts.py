"""The update's parts that reduce, check and clip gradients (``update.py`` says what each does and when; the
optimizers' step is ``stepper.py``). Each part keeps its own state per batch, from the action that starts it to
the one that ends it, and reads and writes the batch's gradients in its ``SetAside``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from ..layout import Keys
from ..schedules import schedule as S
from ..state.ledger import BatchLedger
from . import gradients
from .collectives import Collective, CollectiveOp, GroupName
from .grad_buckets import GradientBuckets, Launched
from .update import SetAside, TiedParameter, UpdatePart, UpdateShape


class BucketReducer(UpdatePart):
    """The replicated gradients' buckets: all-reduced over the replicas (or, ``sharded``, each owner's part reduced
    to it) during the batch's last backward, handed over in flight at REDUCE, waited for and averaged at CHECK
    (sharded under 2BW, one bucket set: at the next batch's first backward if that comes first, ``reclaimed``)."""

    def __init__(self, buckets: GradientBuckets, params: Sequence[nn.Parameter], double_buffered: bool) -> None:
        self.buckets, self.double_buffered = buckets, double_buffered
        self.params = list(params)
        self.launched: dict[int, Launched] = {}

    ACTIONS: ClassVar[dict[S.Kind, str]] = {S.REDUCE: "reduce", S.CHECK: "check"}

    @staticmethod
    def collectives(shape: UpdateShape) -> list[Collective]:
        """Per bucket, in bucket order: one all-reduce, or (sharded) one reduce to each owner in turn."""
        if shape.width == 1:
            return []
        if shape.sharded:  # one set under 2BW: reclaimed by the next batch's first backward
            declared = GradientBuckets.TO_OWNER.times(shape.buckets * shape.width, reclaimed=shape.double_buffered)
        else:
            declared = GradientBuckets.ALL_REDUCE.times(shape.buckets)
        return [declared]

    def reduce(self, batch: int, aside: SetAside) -> None:
        self.launched[batch] = self.buckets.launch(self.double_buffered)  # in flight until CHECK

    def check(self, batch: int, aside: SetAside) -> None:
        averaged = self.buckets.complete(self.launched.pop(batch))
        aside.grads = [averaged.get(id(p), g) for p, g in zip(self.params, aside.grads)]

    def pending_bytes(self) -> int:
        """The set-aside gradients held beside the buckets the next batch accumulates into (sharded under 2BW: this
        replica's share of each batch in flight; else each launched set whole)."""
        return sum(
            self.buckets.kept_bytes()
            if launched.compact
            else sum(b.views[0].element_size() * sum(v.numel() for v in b.views) for b in launched.buckets)
            for launched in self.launched.values()
        )


class TiedSums(UpdatePart):
    """A tied parameter's gradient (e.g. the embedding the first and last stages share): summed over the stages
    holding it (launched at REDUCE on the tied group, waited for at CHECK), then averaged over the replicas (at
    CHECK, once the buckets' all-reduces ahead of it on the replica group are done: issued at REDUCE it would wait
    behind all of them, exposed). Every holder joins the sum, with zeros where no gradient arrived. The sum and the
    average are linear, so their order does not change the value (only its rounding)."""

    def __init__(
        self, shared: Sequence[TiedParameter], params: Sequence[nn.Parameter], replica_group: Any, width: int
    ) -> None:
        self.shared, self.replica_group, self.width = list(shared), replica_group, width
        position = {id(p): i for i, p in enumerate(params)}
        self.positions = [position[id(s.param)] for s in self.shared]
        self.works: dict[int, list[Any]] = {}

    ACTIONS: ClassVar[dict[S.Kind, str]] = {S.REDUCE: "reduce", S.CHECK: "check"}

    SUM: ClassVar = Collective(CollectiveOp.ALL_REDUCE, GroupName.TIED, "tied sum", S.REDUCE, S.CHECK)
    AVERAGE: ClassVar = Collective(
        CollectiveOp.ALL_REDUCE, GroupName.REPLICA, "replica average of tied parameters", S.CHECK
    )

    @classmethod
    def collectives(cls, shape: UpdateShape) -> list[Collective]:
        return [cls.SUM] + [cls.AVERAGE] * (shape.width > 1)

    def reduce(self, batch: int, aside: SetAside) -> None:
        grads = []
        for i, shared in zip(self.positions, self.shared):
            if aside.grads[i] is None:
                aside.grads[i] = torch.zeros_like(shared.param)
            grads.append(aside.grads[i])
        self.works[batch] = [self.SUM.issue(grad, s.group) for grad, s in zip(grads, self.shared)]

    def check(self, batch: int, aside: SetAside) -> None:
        for work in self.works.pop(batch):
            work.wait()
        tied = [g for g in (aside.grads[i] for i in self.positions) if g is not None]
        gradients.average_over_replicas(tied, self.replica_group, self.width, self.AVERAGE)


class StageNorm:
    """This stage's squared gradient norm (a tied parameter counted on the first stage holding it only). Sharded
    gradients: the owners' parts summed over the replicas (on ``shard``'s communicator, where nothing of the next
    batch is queued), the tied parameters, whole on every replica, added after."""

    def __init__(
        self, params: Sequence[nn.Parameter], shared: Sequence[TiedParameter], device: torch.device, shard_group: Any
    ) -> None:
        tied = {id(s.param) for s in shared}
        not_counted = {id(s.param) for s in shared if not s.counts_for_norm}
        self.counted = [id(p) not in not_counted for p in params]
        self.is_tied = [id(p) in tied for p in params]
        self.device, self.shard_group = device, shard_group  # shard_group: None unless gradients are sharded

    def squares(self, grads: Sequence[torch.Tensor | None], owners: Collective) -> torch.Tensor:
        """``owners``: the caller's declaration of the owners' sum (issued at its action)."""
        counted = [(g, t) for g, c, t in zip(grads, self.counted, self.is_tied) if c and g is not None]
        if self.shard_group is None:
            return gradients.squared_norm([g for g, _ in counted], self.device)
        owned = gradients.squared_norm([g for g, tied in counted if not tied], self.device)
        owners.issue(owned, self.shard_group).wait()
        return owned + gradients.squared_norm([g for g, tied in counted if tied], self.device)


class StopOnNonFinite(UpdatePart):
    """``on_nonfinite="stop"``: CHECK computes one flag per gradient and copies them to the host without a sync
    (``gradients.FiniteWatch``); the first update that reads a non-finite one raises, naming its parameters, and
    every drain waits for them all (nothing is saved or evaluated after a non-finite update)."""

    def __init__(
        self,
        ledger: BatchLedger,
        names: Callable[[], dict[int, list[str]]],
        describe: Callable[[], str],
        keys: Keys,
    ) -> None:
        self.ledger, self.names, self.describe, self.keys = ledger, names, describe, keys
        self.watch = gradients.FiniteWatch()

    ACTIONS: ClassVar[dict[S.Kind, str]] = {S.CHECK: "check"}

    def check(self, batch: int, aside: SetAside) -> None:
        with aside.in_grad():
            self.watch.push(self.ledger.global_step(batch), aside.params)
        self.raise_if_nonfinite()

    def at_drain(self) -> None:
        self.raise_if_nonfinite(wait=True)

    def raise_if_nonfinite(self, wait: bool = False) -> None:
        found = self.watch.poll(wait)
        if found is None:
            return
        step, bad = found
        names = self.names()
        shown = [names.get(id(p), ["?"])[0] for p in bad]
        raise FloatingPointError(
            f"non-finite gradients in the batch of step {step} on {self.describe()}"
            f" (e.g. {', '.join(shown[:3])}). Lower the learning rate or clip gradients, check the data, or let the "
            f"pipeline skip such updates: {self.keys.named('on_nonfinite', 'skip')}"
        )


class SkipNonFinite(UpdatePart):
    """``on_nonfinite="skip"``: CHECK launches one flag over the pipeline (with sharded gradients the replicas agree
    on the owners' flags first); HOOKS reads it (the one host sync per update of this policy) and, if any stage saw
    a non-finite gradient, every stage skips the batch's update alike (``ledger.skip``)."""

    def __init__(
        self, ledger: BatchLedger, groups: Any, device: torch.device, sharded: bool, info: Callable[[str], None]
    ) -> None:
        self.ledger, self.groups, self.device, self.sharded, self.info = ledger, groups, device, sharded, info
        self.flags: dict[int, tuple[torch.Tensor, Any]] = {}

    ACTIONS: ClassVar[dict[S.Kind, str]] = {S.CHECK: "check", S.HOOKS: "verdict"}

    OWNERS: ClassVar = Collective(
        CollectiveOp.ALL_REDUCE, GroupName.SHARD, "owners' non-finite flags", S.CHECK, maximum=True
    )
    FLAG: ClassVar = Collective(
        CollectiveOp.ALL_REDUCE, GroupName.PIPELINE, "non-finite flag", S.CHECK, S.HOOKS, maximum=True
    )

    @classmethod
    def collectives(cls, shape: UpdateShape) -> list[Collective]:
        return [cls.OWNERS] * shape.sharded + [cls.FLAG]

    def check(self, batch: int, aside: SetAside) -> None:
        flag = gradients.nonfinite_flag([g for g in aside.grads if g is not None], self.device)
        if self.sharded:
            self.OWNERS.issue(flag, self.groups.shard).wait()
        self.flags[batch] = (flag, self.FLAG.issue(flag, self.groups.pipeline))

    def verdict(self, batch: int, aside: SetAside) -> None:
        flag, work = self.flags.pop(batch)
        work.wait()
        if flag.item() == 0:
            return
        step = self.ledger.global_step(batch)
        self.ledger.skip(batch)
        self.ledger.skipped_updates.append(step)
        self.info(
            f"pd2bw: non-finite gradients in the batch of step {step}: its update is skipped on "
            f"every stage ({len(self.ledger.skipped_updates)} skipped so far)"
        )


class BeforeStepHooks(UpdatePart):
    """HOOKS: ``before_step(optimizer)`` once per optimizer with the batch's gradients in ``.grad`` (Lightning:
    ``on_before_optimizer_step`` of the callbacks, then of the module; e.g. the sparsity masks), unless skipped."""

    def __init__(
        self, ledger: BatchLedger, optimizers: Sequence[torch.optim.Optimizer], before_step: Callable[..., None]
    ) -> None:
        self.ledger, self.optimizers, self.before_step = ledger, list(optimizers), before_step

    ACTIONS: ClassVar[dict[S.Kind, str]] = {S.HOOKS: "hooks"}

    def hooks(self, batch: int, aside: SetAside) -> None:
        if self.ledger.is_skipped(batch):
            return
        with aside.in_grad():
            for optimizer in self.optimizers:
                self.before_step(optimizer)


class GlobalNormClip(UpdatePart):
    """Clipping by the norm over the whole pipeline: NORM launches this stage's squared norm as a sum over the
    pipeline (every stage skips alike, so the collective is issued by all or none); CLIP waits and scales."""

    def __init__(self, ledger: BatchLedger, norm: StageNorm, pipeline_group: Any, max_norm: float) -> None:
        self.ledger, self.norm, self.pipeline_group, self.max_norm = ledger, norm, pipeline_group, max_norm
        self.launched: dict[int, tuple[torch.Tensor, Any]] = {}

    ACTIONS: ClassVar[dict[S.Kind, str]] = {S.NORM: "launch", S.CLIP: "clip"}

    OWNERS: ClassVar = Collective(CollectiveOp.ALL_REDUCE, GroupName.SHARD, "owners' clip norm", S.NORM)
    NORM: ClassVar = Collective(CollectiveOp.ALL_REDUCE, GroupName.PIPELINE, "clip norm", S.NORM, S.CLIP)

    @classmethod
    def collectives(cls, shape: UpdateShape) -> list[Collective]:
        return [cls.OWNERS] * shape.sharded + [cls.NORM]

    def launch(self, batch: int, aside: SetAside) -> None:
        if self.ledger.is_skipped(batch):
            return
        squares = self.norm.squares(aside.grads, self.OWNERS)
        self.launched[batch] = (squares, self.NORM.issue(squares, self.pipeline_group))

    def clip(self, batch: int, aside: SetAside) -> None:
        if batch not in self.launched:
            return
        squares, work = self.launched.pop(batch)
        work.wait()
        gradients.scale_to_norm([g for g in aside.grads if g is not None], squares, self.max_norm)


class StageNormClip(UpdatePart):
    """``clip_mode="stage"``: CLIP scales by this stage's own gradient norm."""

    def __init__(self, ledger: BatchLedger, norm: StageNorm, max_norm: float) -> None:
        self.ledger, self.norm, self.max_norm = ledger, norm, max_norm

    ACTIONS: ClassVar[dict[S.Kind, str]] = {S.CLIP: "clip"}

    OWNERS: ClassVar = Collective(CollectiveOp.ALL_REDUCE, GroupName.SHARD, "owners' clip norm", S.CLIP)

    @classmethod
    def collectives(cls, shape: UpdateShape) -> list[Collective]:
        return [cls.OWNERS] * shape.sharded

    def clip(self, batch: int, aside: SetAside) -> None:
        if not self.ledger.is_skipped(batch):
            squares = self.norm.squares(aside.grads, self.OWNERS)
            gradients.scale_to_norm([g for g in aside.grads if g is not None], squares, self.max_norm)


class ClipByValue(UpdatePart):
    """``gradient_clip_algorithm="value"``: CLIP clamps every gradient entry to [-value, value]."""

    def __init__(self, ledger: BatchLedger, value: float) -> None:
        self.ledger, self.value = ledger, value

    ACTIONS: ClassVar[dict[S.Kind, str]] = {S.CLIP: "clip"}

    def clip(self, batch: int, aside: SetAside) -> None:
        if not self.ledger.is_skipped(batch):
            for grad in aside.grads:
                if grad is not None:
                    grad.clamp_(min=-self.value, max=self.value)
