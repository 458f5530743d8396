"""The update of one batch, identical on every stage, made of parts with one job each (the one home of this text).

``schedule.update(b)`` places the update's actions (``engine/schedules/schedule.py``): REDUCE, CHECK, HOOKS, NORM, CLIP,
STEP and PUBLISH of batch b. Under 2BW the update of batch b is first read by batch b + 2's first forward, so it runs
while batch b + 1 computes: REDUCE(b) right after b's last backward on the stage, CHECK/HOOKS/NORM(b) half a batch
later, beside batch b + 1 (``schedule.prepare_after``: the buckets' all-reduce has that long to finish), CLIP and
STEP(b) ``d - 1`` forwards after that, PUBLISH(b) at the end of step b + 1 (``schedule.finish_after``: the owners'
broadcasts have the rest of the batch to finish; without room, all three at the end of step b + 1; flush and gpipe
run them back to back). The rule is unchanged, W(t+1) = W(t) - lr * grad f(W(t-1)): only when the work is done
moved.

``UpdateRule`` (here) keeps the dispatch and the set-aside ledger: at REDUCE(b) the next weight version is made
writable and batch b's gradients are taken out of ``.grad`` into a ``SetAside`` (the next batch's backwards then
accumulate afresh); a part that needs them in ``.grad`` (the optimizers, the hooks) runs ``with aside.in_grad():``,
which puts them there on the writable weights and the next batch's back afterwards. Every other part reads and
writes ``aside.grads`` directly. ``update_build.build_update`` picks, once, from the resolved run, the parts; each
registers a handler only at the actions it acts at (``UpdatePart.handlers``), run in the builder's order, and declares
the collectives it issues as data (``UpdatePart.collectives``, read by the NCCL lowering and the planner's simulator):

- the gradient store (``gradient_store.py``): where every stage parameter's gradient accumulates (the float32 main
  gradients of bf16 weight versions, tied parameters included); it takes them aside at REDUCE;
- the reducer (``update_parts.py``): ``BucketReducer`` (width > 1, or mixed weights at width 1 with no collective):
  the buckets' replica all-reduces (``shard_gradients``: reduces to the owners), started during the last backward,
  handed over in flight at REDUCE and waited for at CHECK; no part at width 1 with unmixed weights;
- ``TiedSums``: a tied parameter's gradient summed over the stages holding it (launched at REDUCE, waited for at
  CHECK), then averaged over the replicas at CHECK, behind the buckets on the replica group;
- the non-finite policy: ``StopOnNonFinite`` (CHECK: flags copied to the host without a sync, raised at the first
  update that reads them and at every drain) or ``SkipNonFinite`` (CHECK: one flag summed over the pipeline,
  launched; HOOKS: read, and the batch's update skipped on every stage alike);
- ``BeforeStepHooks`` (HOOKS): ``before_step`` once per optimizer (Lightning: ``on_before_optimizer_step``);
- the clipper: ``GlobalNormClip`` (NORM: this stage's squared norm launched as a sum over the pipeline; CLIP: waited
  for, every gradient scaled), ``StageNormClip`` or ``ClipByValue`` (CLIP), or none;
- the ``Stepper`` (``stepper.py``, STEP): every optimizer's ``step()`` with the hyper-parameters batch b was fed
  with, 2BW's delay correction (``delay_correction.py``), the optimizers' post-hooks, and with the optimizer sharded
  the owners' broadcasts of the new weights launched (every replica, skipped or not), waited for at PUBLISH.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from ..layout import Word
from ..schedules import schedule as S
from ..state.versions import WeightVersions
from .collectives import Collective

if TYPE_CHECKING:
    from .gradient_store import GradientStore

Handler = Callable[[int, "SetAside"], None]  # (batch, its set-aside update; PUBLISH: after STEP released it, None)


@dataclass
class SetAside:
    """Batch b's gradients from REDUCE(b) to STEP(b), one per stage parameter (None where none arrived, or, with
    sharded gradients, where another replica owns it)."""

    params: Sequence[nn.Parameter]
    grads: list[torch.Tensor | None]
    writable: Callable[[], None]  # points the parameters at the weights the update writes

    @contextmanager
    def in_grad(self) -> Iterator[None]:
        """Batch b's gradients in ``.grad`` on the writable weights; afterwards they (as the body left them: a hook
        may replace one) go back aside and the next batch's, accumulated meanwhile, return to ``.grad``."""
        self.writable()
        current = [param.grad for param in self.params]
        for param, grad in zip(self.params, self.grads):
            param.grad = grad
        try:
            yield
        finally:
            self.grads = [param.grad for param in self.params]
            for param, grad in zip(self.params, current):
                param.grad = grad

    @property
    def nbytes(self) -> int:
        return sum(g.numel() * g.element_size() for g in self.grads if g is not None)


class ClipKind(Word):
    VALUE = "value"  # each gradient clamped
    STAGE = "stage"  # by this stage's norm
    GLOBAL = "global"  # by the pipeline's norm


class NonFinite(Word):
    STOP = "stop"  # the stage that sees one raises
    SKIP = "skip"  # every stage drops the update


@dataclass(frozen=True)
class UpdateShape:
    """What decides one stage's update: which parts it has (``update_build.choose_parts``) and which collectives
    they issue (``UpdatePart.collectives``). The engine's builder and the NCCL lowering (``verify/comm_plan.py``)
    both read it, so the collectives are described once."""

    double_buffered: bool  # 2BW: a batch's update runs beside the next batch's compute
    width: int = 1  # replicas of this stage
    buckets: int = 0  # replicated gradient buckets (0: no reducer)
    tied: bool = False  # this stage holds a parameter another stage holds too
    sharded: bool = False  # shard_gradients in effect: each bucket's owners' parts reduced to them
    owners_broadcast: bool = False  # width > 1, the optimizer sharded: each owner broadcasts its weights after STEP
    nonfinite: NonFinite = NonFinite.STOP  # the non-finite policy
    hooks: bool = True  # before-step hooks (Lightning: on_before_optimizer_step)
    clip: ClipKind | None = None  # None: no clipping

    def __post_init__(self) -> None:  # the words given as strings (options, layouts) checked and typed here
        object.__setattr__(self, "nonfinite", NonFinite(self.nonfinite))
        object.__setattr__(self, "clip", None if self.clip is None else ClipKind(self.clip))

    @classmethod
    def of(
        cls,
        mode: str,
        width: int,
        *,
        shard_optimizer: bool,
        shard_gradients: bool,
        nonfinite: str,
        clip: str | None,
        buckets: int,
        tied: bool,
        hooks: bool = True,
    ) -> UpdateShape:
        """The shape of a stage's update from the run's options and the stage's facts: the one derivation the engine's
        builder, the NCCL lowering and the planner's timing share (sharding only at width > 1:
        ``layout.sharded_at``)."""
        from ..layout import Mode, sharded_at

        owners = sharded_at(width, shard_optimizer)
        return cls(
            Mode(mode).double_buffered,
            width,
            buckets=buckets,
            tied=tied,
            sharded=owners and shard_gradients,
            owners_broadcast=owners,
            nonfinite=nonfinite,
            hooks=hooks,
            clip=clip,
        )


class UpdatePart:
    """One job of the update: ``ACTIONS`` maps each action kind it acts at to the name of its ``(batch, aside)``
    handler (data: the lowering, ``lowering.py``, reads it without an instance); ``collectives`` declares, for a stage
    of that shape, the collectives those handlers issue (in their order)."""

    ACTIONS: ClassVar[dict[S.Kind, str]] = {}

    def handler(self, kind: S.Kind) -> Handler:
        return getattr(self, self.ACTIONS[kind])

    @staticmethod
    def collectives(shape: UpdateShape) -> list[Collective]:
        return []

    def pending_bytes(self) -> int:
        """Gradient bytes this part holds for batches between REDUCE and STEP (e.g. buckets in flight)."""
        return 0

    def at_drain(self) -> None:
        """Everything this part deferred is settled (a drain: before a save, an evaluation or the end)."""


@dataclass
class UpdateRule:
    """The dispatch of one stage's update over its parts, and the set-aside ledger (batch -> its ``SetAside``)."""

    params: list[nn.Parameter]  # this stage's own parameters
    versions: WeightVersions
    store: GradientStore
    parts: list[UpdatePart]
    double_buffered: bool  # 2BW: a batch's update runs beside the next batch's compute
    pending: dict[int, SetAside] = field(default_factory=dict)
    peak_pending_bytes: int = 0
    declared: Sequence[tuple[type[UpdatePart], Sequence[Collective]]] = ()  # the parts' declarations (lowering)

    def handlers(self) -> dict[S.Kind, Callable[[Any], None]]:
        """The update's actions for the executor's table (``StageExecutor(handlers=)``): each runs, for its lowered op
        (``lowering.Op``), the parts ``op.ran()`` names, in that order; they are this rule's parts acting there."""
        instances = {type(part): part for part in self.parts}
        acting = {kind: [type(p) for p in self.parts if kind in p.ACTIONS] for kind in S.UPDATE_KINDS}

        def dispatch(kind: S.Kind) -> Callable[[Any], None]:
            def run(op: Any) -> None:
                ran = op.ran()
                if ran != acting[kind]:  # the lowering was made for another update: never run it halfway
                    raise RuntimeError(f"pd2bw: {op.action} lowered for parts {ran}, this stage has {acting[kind]}")
                batch = op.batch
                if kind == S.REDUCE:
                    self._begin(batch)
                aside = self.pending[batch] if kind != S.PUBLISH else None  # STEP released the batch's gradients
                for part in ran:
                    instances[part].handler(kind)(batch, aside)  # type: ignore[arg-type]
                if kind == S.REDUCE and self.double_buffered:
                    self.peak_pending_bytes = max(self.peak_pending_bytes, self.pending_bytes)
                if kind == S.STEP:
                    self.pending.pop(batch)
                    self.store.after_step(self.double_buffered)

            return run

        return {kind: dispatch(kind) for kind in S.UPDATE_KINDS}

    def _begin(self, batch: int) -> None:
        """REDUCE(b): the next weight version made writable; batch b's gradients taken aside."""
        self.versions.begin_update()  # the update's hooks, clipping and step all see the newest weights
        self.pending[batch] = SetAside(self.params, self.store.take(), self.versions.use_writable)

    @property
    def pending_bytes(self) -> int:
        """The set-aside gradients held now (2BW: one batch's, from its REDUCE to its STEP, beside the next batch's
        accumulating ones; flush and gpipe hold them only within their update)."""
        if not self.double_buffered:
            return 0
        return sum(aside.nbytes for aside in self.pending.values()) + sum(p.pending_bytes() for p in self.parts)

    def attach_gradients(self) -> None:
        """Before a batch's compute: every gradient the batch accumulates into is in place."""
        self.store.attach()

    def at_drain(self) -> None:
        for part in self.parts:
            part.at_drain()


@dataclass
class TiedParameter:
    """A parameter several stages hold (a tied weight): its group, the rank that broadcasts it at the start, and
    whether this stage counts it in the clip norm (only the first stage holding it does)."""

    param: nn.Parameter
    group: Any
    source: int
    counts_for_norm: bool
