"""The one lowering: a stage's actions (``schedule.segment`` / ``drain``) with its update's parts
(``update_build.collectives``) into the ops the stage executes, in order, and what ends a training step.

Three readers run the same ops: the executor (``executor.StageExecutor.run``: its compute and transport handlers, the
update's parts in ``Op.steps``' order through ``update.UpdateRule.run``), the NCCL model (``verify/comm_plan.py``:
each op's sends, receives and declared collectives) and the planner's simulator (``planner/simulate.py``: each op
timed). None of them derives which receive a send is batched with (``Op.fused``), which backward is its batch's last
on the stage (``Op.last``: the buckets' reduces start in it), what the update does at an action and in which order
(``Op.steps``); the ops say it once. How a training step ends is in its actions (``program.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from . import schedule as S

if TYPE_CHECKING:  # the parts' types: the runtime's (engine/updates), read here only by their attributes
    from ..updates.collectives import Collective
    from ..updates.update import UpdatePart

__all__ = ["ISSUE", "RUN", "WAIT", "Op", "Parts", "Step", "at_action", "lower"]

Parts = Sequence[tuple[type["UpdatePart"], Sequence["Collective"]]]  # ``update_build.collectives(shape)``


class Step(str, Enum):
    """What the update does for one part at an action (``at_action``): its text form is the value."""

    WAIT = "wait"  # wait for the collectives the part launched before
    RUN = "run"  # run the part's handler
    ISSUE = "issue"  # issue a collective the part declares

    def __str__(self) -> str:
        return self.value


WAIT, RUN, ISSUE = Step.WAIT, Step.RUN, Step.ISSUE
PartStep = tuple[Step, type["UpdatePart"], "Collective | None"]  # (WAIT | RUN | ISSUE, the part, its collective)


def at_action(parts: Parts, kind: S.Kind) -> Iterator[PartStep]:
    """What the update does at ``kind``, in the engine's order (the lowering the NCCL model and the planner's
    simulator both read): part by part, each part first waits for the collectives it launched before (``WAIT``),
    then runs its handler's own work (``RUN``), then issues its collectives (``ISSUE``; waited as issued where
    ``waited`` is None)."""
    for part, declared in parts:
        for collective in declared:
            if collective.waited == kind and collective.issued != kind:
                yield WAIT, part, collective
        yield RUN, part, None
        for collective in declared:
            if collective.issued == kind:
                yield ISSUE, part, collective


@dataclass(frozen=True)
class Op:
    """One action as its stage executes it.

    ``fused``: for a send, the receive posted in one batch with it (``schedule.fuse_receives``); ``last``: for a
    backward (for a W where the backward is split), whether it is its batch's last on this stage; ``steps``: for an update action, its parts' steps in
    order (each part waits for what it launched before, runs its handler where it acts at this kind, issues what it
    declares: ``at_action``); for a batch's last backward, the collectives issued during it (the
    buckets' replica reduces); ``reclaims``: for a batch's first backward, the previous batch's collectives still
    reading the buffers it accumulates into (``Collective.reclaimed``), waited for before it unless their own wait
    came first. ``index``: the action's position in the list (a failure's listing marks it)."""

    action: S.Action
    index: int
    fused: S.Action | None = None
    last: bool = False
    steps: tuple[PartStep, ...] = ()
    reclaims: tuple[PartStep, ...] = ()  # a batch's first backward: the previous batch's collectives it waits for

    @property
    def kind(self) -> S.Kind:
        return self.action.kind

    @property
    def batch(self) -> int:
        return self.action.batch

    @property
    def microbatch(self) -> int:
        return self.action.microbatch

    @property
    def weight_version(self) -> int:
        return self.action.weight_version

    @property
    def chunk(self) -> int:
        return self.action.chunk

    def __str__(self) -> str:
        return str(self.action)

    def issued(self) -> list[Collective]:
        """The declared collectives this op issues, in order (each ``repeat`` times)."""
        return [collective for step, _, collective in self.steps if step == ISSUE and collective is not None]

    def ran(self) -> list[type[UpdatePart]]:
        """The parts whose handler this op runs, in order."""
        return [part for step, part, _ in self.steps if step == RUN]


def _update_steps(parts: Parts, kind: S.Kind) -> tuple[PartStep, ...]:
    """The update's steps at ``kind``: a part runs only where it acts (``UpdatePart.ACTIONS``)."""
    return tuple(
        (step, part, collective)
        for step, part, collective in at_action(parts, kind)
        if step != RUN or kind in part.ACTIONS
    )


def _fused_by_segment(actions: Sequence[S.Action]) -> dict[int, S.Action]:
    """``schedule.fuse_receives`` within each segment (a program's segments end at their ``LOSS``): a send never
    batches a receive of the next segment or drain (its peer posts that one in a later call)."""
    fused: dict[int, S.Action] = {}
    start = 0
    for end in [i + 1 for i, action in enumerate(actions) if action.kind == S.LOSS] + [len(actions)]:
        fused.update({start + i: receive for i, receive in S.fuse_receives(actions[start:end]).items()})
        start = end
    return fused


def lower(actions: Sequence[S.Action], parts: Parts, num_microbatches: int) -> list[Op]:
    """The ops of ``actions`` on a stage whose update has ``parts``, batches of ``num_microbatches``."""
    top = max((action.chunk for action in actions), default=0)  # interleaved: backwards run the last chunk first
    # interleaved 1F1B's ring carries both directions between one pair of ranks: every message goes alone, in the
    # schedule's order on both ends (no receive is posted early, ahead of another from the same peer)
    fused = _fused_by_segment(actions) if top == 0 else {}
    at_last_backward = _update_steps(parts, S.BACKWARD)
    reclaims = tuple((WAIT, part, c) for part, declared in parts for c in declared if c.reclaimed)
    update = {kind: _update_steps(parts, kind) for kind in S.UPDATE_KINDS}
    # under a split backward (ZB-H1) a batch's gradients are complete at its last W, not its last B
    split = any(action.kind == S.WEIGHT for action in actions)
    ops: list[Op] = []
    for index, action in enumerate(actions):
        if action.kind in S.UPDATE_KINDS:
            ops.append(Op(action, index, steps=update[action.kind]))
        elif action.kind in (S.BACKWARD, S.WEIGHT):
            # a stage runs its backwards (and its W) in microbatch order, under every schedule: the batch's highest
            # is its last (interleaved: on its first chunk, the last a batch's backwards reach)
            last = (action.microbatch + 1) % num_microbatches == 0 and (action.kind == S.WEIGHT) == split
            last = last and action.chunk == 0
            first = action.microbatch % num_microbatches == 0 and action.kind == S.BACKWARD and action.chunk == top
            ops.append(
                Op(action, index, last=last, steps=at_last_backward if last else (), reclaims=reclaims if first else ())
            )
        else:
            ops.append(Op(action, index, fused=fused.get(index)))
    return ops
