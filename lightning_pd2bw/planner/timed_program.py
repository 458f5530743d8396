"""The simulator's program: each stage's training steps (``program.train_step``, lowered by ``lowering.lower``) as
timed operations, ``(op, *arguments)`` tuples that ``simulate.run`` executes: compute with its seconds, a message sent
or its receive posted or waited for, a collective issued on its communicator or waited for, a step's end marked. The
costs come from ``StageCosts``; which operations, in which order, from the engine's own program.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from enum import IntEnum

from ..engine.comm.grid import communicator
from ..engine.layout import Layout
from ..engine.schedules import program
from ..engine.schedules import schedule as S
from ..engine.schedules.lowering import ISSUE as ISSUE_PART
from ..engine.schedules.lowering import RUN as RUN_PART
from ..engine.schedules.lowering import WAIT as WAIT_PART
from ..engine.schedules.lowering import Op
from ..engine.schedules.lowering import lower as lower_actions
from ..engine.updates import update_build as U
from ..engine.updates import update_parts as P
from ..engine.updates.collectives import Collective
from ..engine.updates.stepper import Stepper
from ..engine.updates.update import UpdatePart, UpdateShape
from .stage_costs import StageCosts, rank_costs


class Timed(IntEnum):
    """What a timed operation does (the first element of its tuple; the rest are its arguments)."""

    COMPUTE = 0  # (COMPUTE, seconds)
    SEND = 1  # (SEND, link, message, seconds)
    POST = 2  # (POST, message): a receive posted early, in a send's batch
    RECV = 3  # (RECV, message): wait for it
    ISSUE = 4  # (ISSUE, channel, number, members, seconds): a collective
    WAIT = 5  # (WAIT, channel, number, blocked_on_the_update)
    WAIT_SENDS = 6  # (WAIT_SENDS,): every message this stage sent delivered
    MARK = 7  # (MARK, step): a training step ends
    DELIVERED = 8  # (DELIVERED, message): wait until a message this stage sent has arrived


COMPUTE, SEND, POST, RECV, ISSUE, WAIT, WAIT_SENDS, MARK, DELIVERED = Timed


_reads: Callable[[StageCosts], float] = operator.attrgetter("read_gradients")  # the gradients read once
# the update's parts that compute on the device, where, and how long (``update_parts.py``, ``stepper.py``)
PART_COMPUTE: dict[type[UpdatePart], tuple[S.Kind, Callable[[StageCosts], float]]] = {
    P.StopOnNonFinite: (S.CHECK, _reads),  # one flag per gradient
    P.SkipNonFinite: (S.CHECK, _reads),
    P.GlobalNormClip: (S.NORM, _reads),  # the squared norm
    P.StageNormClip: (S.CLIP, _reads),
    P.ClipByValue: (S.CLIP, _reads),
    Stepper: (S.STEP, lambda costs: costs.step),
}


class _Lowering:
    """One stage's timed operations: ``(op, *arguments)`` tuples in the stage's order."""

    def __init__(self, layout: Layout, stage: int, costs: Sequence[StageCosts], cost_of: CollectiveCost) -> None:
        self.layout, self.stage, self.costs, self.cost_of = layout, stage, costs, cost_of
        self.mine = rank_costs(costs, layout, stage)  # the rank's update (interleaved: over its chunks)
        self.parts = U.collectives(self.mine.shape)
        self.ops: list[tuple] = []
        self.issued: dict[str, int] = {}  # channel -> collectives issued on it so far
        self.inflight: dict[tuple[int, Collective], list[tuple[str, int]]] = {}
        self.loss: dict[int, tuple[str, int]] = {}
        self.groups: dict[str, tuple[str, tuple[int, ...]]] = {}
        self.seconds_of: dict[Collective, float] = {}
        self.sigterm: tuple[str, int] | None = None

    def issue(self, channel: str, members: tuple[int, ...], seconds: float) -> tuple[str, int]:
        number = self.issued.get(channel, 0)
        self.issued[channel] = number + 1
        self.ops.append((ISSUE, channel, number, members, seconds))
        return channel, number

    def wait(self, handle: tuple[str, int], update: bool = False) -> None:
        self.ops.append((WAIT, *handle, update))

    def group(self, name: str) -> tuple[str, tuple[int, ...]]:
        """The communicator ``name`` of this stage in replica 0 (``grid.communicator``), its members as stages:
        replicas run alike, so a replica group's collective starts as soon as its stage issues it."""
        if name not in self.groups:
            d = self.layout.num_stages
            channel, ranks = communicator(name, self.stage, 0, d, 1, tied=(0, d - 1))
            self.groups[name] = channel, tuple(sorted({rank % d for rank in ranks}))
        return self.groups[name]

    def seconds(self, collective: Collective) -> float:
        """One issue of ``collective`` on this stage (``cost_of``, once per collective)."""
        if collective not in self.seconds_of:
            self.seconds_of[collective] = self.cost_of(self.stage, collective)
        return self.seconds_of[collective]

    def update(self, op: Op) -> None:
        """The update's steps at ``op`` (``lowering.Op.steps``, what ``verify/comm_plan.py`` issues), timed: each part
        waits for what it launched before, computes, then issues its collectives."""
        kind, batch = op.kind, op.batch
        for step, part, collective in op.steps:
            if step == WAIT_PART:  # (none left: the next batch's first backward reclaimed them)
                for handle in self.inflight.pop((batch, collective), []):
                    self.wait(handle, update=True)
            elif step == RUN_PART and part in PART_COMPUTE and PART_COMPUTE[part][0] == kind:
                self.ops.append((COMPUTE, PART_COMPUTE[part][1](self.mine)))
            elif step == ISSUE_PART and collective is not None:
                channel, members = self.group(collective.group)
                seconds = self.seconds(collective)
                handles = [self.issue(channel, members, seconds) for _ in range(collective.repeat)]
                if collective.waited is None:
                    for handle in handles:
                        self.wait(handle, update=True)
                else:
                    self.inflight[(batch, collective)] = handles

    def segment(self, step: int, synchronous: bool = False) -> None:
        """Training step ``step`` (since the last drain; ``synchronous``: one of 2BW's start, drained at once), timed:
        its whole program (``program.train_step``) with the stop agreement at its head."""
        mine, ops, dispatch, costs = self.mine, self.ops, self.mine.dispatch, self.costs
        split = self.layout.mode.splits_backward
        d = self.layout.num_stages
        for code, op, first, second in _segment_plan(self.layout, self.stage, step, mine.shape, synchronous):
            if code == _FLAG:  # the previous step's agreement read, this one's posted; the strategy's host work
                self.flag()
                continue
            if dispatch and code not in _STEP_END:
                ops.append((COMPUTE, dispatch))
            chunk = costs[op.action.chunk * d + self.stage]  # the costs of the op's (virtual) stage
            if code == _FORWARD:
                ops.append((COMPUTE, chunk.forward))
            elif code == _BACKWARD:
                backward = chunk.backward - (chunk.weight_grad if split else 0.0)
                # the previous batch's reduces still reading the buckets this backward fills: bucket by bucket, in the
                # order the backward fills them (the order they were issued), each before its share of the backward
                reclaimed = [h for _, _, c in op.reclaims for h in self.inflight.pop((op.batch - 1, c), [])]
                for handle in reclaimed:
                    self.wait(handle, update=True)
                    ops.append((COMPUTE, backward / len(reclaimed)))
                if not reclaimed:
                    ops.append((COMPUTE, backward))
                if op.last:
                    self.update(op)
            elif code == _WEIGHT:  # a split backward's deferred weight gradients
                ops.append((COMPUTE, mine.weight_grad))
                if op.last:
                    self.update(op)
            elif code == _SEND:  # first: (link, message, boundary), second: the receive posted with it (or None)
                link, message, boundary = first
                ops.append((SEND, link, message, costs[boundary].send))  # the gradient back: as large
                if second is not None:
                    ops.append(second)
            elif code in (_RECV, _ARRIVE):
                ops.append(first)
            elif code in (_WAIT_SENDS, _DRAINED):
                ops.append((WAIT_SENDS,))
            elif code == _TAKE_LOSS:
                self.take_loss(op.batch)
            elif code == _LOSS:
                self.loss[op.batch] = self.issue(*self.group("loss"), 0.0)  # a scalar: its latency
            else:
                self.update(op)

    def take_loss(self, batch: int) -> None:
        if batch in self.loss:
            self.wait(self.loss.pop(batch))

    def flag(self) -> None:
        """FLAG: the stop agreement over the world (a scalar: its latency), then the strategy's per-step host work."""
        if self.sigterm is not None:
            self.wait(self.sigterm)
        self.sigterm = self.issue("world", tuple(range(self.layout.num_stages)), 0.0)
        if self.costs[self.stage].per_step:
            self.ops.append((COMPUTE, self.costs[self.stage].per_step))


CollectiveCost = Callable[[int, Collective], float]  # (stage, declared collective) -> seconds of one issue


class _Code(IntEnum):
    """How ``_Lowering.segment`` times a lowered op (``_segment_plan``)."""

    FORWARD, BACKWARD, WEIGHT, SEND, RECV, WAIT_SENDS, LOSS, UPDATE, FLAG, DRAINED, TAKE_LOSS, ARRIVE = range(12)


_FORWARD, _BACKWARD, _WEIGHT, _SEND, _RECV, _WAIT_SENDS, _LOSS, _UPDATE, _FLAG, _DRAINED, _TAKE_LOSS, _ARRIVE = _Code
_STEP_END = (_FLAG, _DRAINED, _TAKE_LOSS, _ARRIVE)  # the step's head and end, a tick's waits: no dispatch of their own
_CODES = {S.FORWARD: _FORWARD, S.BACKWARD: _BACKWARD, S.WEIGHT: _WEIGHT, S.WAIT_SENDS: _WAIT_SENDS, S.LOSS: _LOSS}
_CODES |= {S.FLAG: _FLAG, S.DRAINED: _DRAINED, S.TAKE_LOSS: _TAKE_LOSS}
_COMPUTES = (S.FORWARD, S.BACKWARD)
_UNTIMED = (S.SETTLE, S.RESTART, S.LAST_FLAG)  # the update's waits at a drain are its declared collectives' own


@functools.lru_cache(maxsize=4096)
def _segment_plan(layout: Layout, stage: int, step: int, shape: UpdateShape, synchronous: bool = False) -> tuple:
    """The lowered ops of ``stage``'s training step ``step`` (``program.train_step``, ``lowering.lower``), each as
    ``(code, op, first, second)`` with what needs no cost worked out once (a message's link and name, its posted
    receive): the schedule's, not the costs', so the candidates that differ only in costs (placement, gradients,
    recomputation, the cluster) share them."""
    plan = []
    d = layout.num_stages
    virtual = d * layout.virtual_stages  # a message is named by its sender's virtual stage (one chunk a rank: the rank)
    actions = program.train_step(layout, stage, step, synchronous=synchronous, flag=True)
    # the ring's (interleaved 1F1B): each tick's batch, its messages waited for as a whole (one NCCL kernel) by the first
    # compute reading one, with every batch before it (its communicator runs them in order)
    ticks: list[list[tuple]] = []
    tick: list[tuple] = []
    ticks_waited = 0
    arriving: dict[tuple[bool, int, int], int] = {}  # a receive posted, by (gradient?, chunk, microbatch) -> its tick
    for op in lower_actions(actions, U.collectives(shape), layout.num_microbatches):
        if op.kind in _UNTIMED:
            continue
        kind, micro, here = op.kind, op.microbatch, op.action.chunk * d + stage
        first = second = None
        if kind in (S.SEND_FORWARD, S.SEND_BACKWARD):
            code, to = _SEND, here + 1 if kind == S.SEND_FORWARD else here - 1
            peer = to % d if virtual > d else to
            first = ((stage, peer), (here, kind, micro), min(here, to))  # the boundary's costs: the lower stage's
            if op.fused is not None:  # the receive batched with this send is posted now
                sender = S.SEND_FORWARD if op.fused.kind == S.RECV_FORWARD else S.SEND_BACKWARD
                at = op.fused.chunk * d + stage
                second = (POST, (at - 1 if sender == S.SEND_FORWARD else at + 1, sender, op.fused.microbatch))
        elif kind in S.RECEIVES:
            message = (
                (here - 1, S.SEND_FORWARD, micro) if kind == S.RECV_FORWARD else (here + 1, S.SEND_BACKWARD, micro)
            )
            if virtual > d:  # the ring's lockstep: posted in its tick's batch, waited for by the compute reading it
                code, first, arriving[(kind == S.RECV_BACKWARD, op.chunk, micro)] = _RECV, (POST, message), len(ticks)
                tick.append((RECV, message))
            else:
                code, first = _RECV, (RECV, message)
        elif kind == S.TICK:  # the batch issued (its dispatch timed); waited for where a compute reads it
            code = _UPDATE
            ticks.append(tick)
            tick = []
        else:
            code = _CODES.get(kind, _UPDATE)
            waited = arriving.pop((kind == S.BACKWARD, op.chunk, micro), None) if kind in _COMPUTES else None
            while waited is not None and ticks_waited <= waited:  # its tick's batch whole, and every one before
                plan += [(_ARRIVE, op, wait, None) for wait in ticks[ticks_waited]]
                ticks_waited += 1
        if code == _SEND and virtual > d:
            tick.append((DELIVERED, first[1]))
        plan.append((code, op, first, second))
    return tuple(plan)


def lower(
    layout: Layout, costs: Sequence[StageCosts], cost_of: CollectiveCost, steps: int, sync_steps: int = 0
) -> list[list[tuple]]:
    """Every stage's timed operations for ``steps`` training steps, the first ``sync_steps`` of 2BW's synchronous
    start (``program.Scenario``), each step's end marked."""
    scenario = program.Scenario(steps, sync_steps)
    programs = []
    for stage in range(layout.num_stages):
        lowering = _Lowering(layout, stage, costs, cost_of)
        in_run = 0
        for step in range(steps):
            synchronous = scenario.synchronous(layout, step)
            lowering.segment(in_run, synchronous)
            in_run = 0 if layout.mode.flushes or synchronous else in_run + 1
            lowering.ops.append((MARK, step))
        programs.append(lowering.ops)
    return programs
