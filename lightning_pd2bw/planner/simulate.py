"""The planner's clock: the engine's own per-stage action lists, timed.

``simulate`` lowers what every stage of one pipeline replica executes for a few training steps into timed
operations and runs them: ``schedule.segment`` of each step (and its fused receives, ``schedule.fuse_receives``),
the update's parts with the collectives each declares (``update_build.collectives``: what ``verify/comm_plan.py``
lowers for the NCCL model), and the strategy's per step: the SIGTERM flag over the world and the loss broadcast it
waits for (``lightning/preemption.py``, ``LOSS``). Dependencies are the engine's:

- an operation starts when the one before it on its stage is done (compute: a forward, a backward with its
  recomputation, the optimizer's step, the gradients read for the norm and the flags);
- a message travels once it is sent and its receive is posted (at the receive, or earlier at the send it is
  batched with), one at a time per link and direction, in ``latency + bytes / bandwidth``; a receive waits for it;
  a drain (``WAIT_SENDS``) waits for every message its stage sent;
- a collective starts when every member has issued it and the one before it on its communicator is done; a part
  that waits for it blocks its stage until it ends. Replicas run alike, so a replica group's collective starts as
  soon as its stage issues it.

The step time is the steady state's (2BW: after its first two steps); ``exposed`` is, per stage, the time a step
spends blocked on the update's collectives. Costs come from ``cost.py`` (``StageCosts``); the simulator knows no
formula of its own.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

from ..engine.comm.grid import communicator
from ..engine.layout import Layout
from ..engine.schedules import schedule as S
from ..engine.schedules.lowering import ISSUE as ISSUE_PART
from ..engine.schedules.lowering import RUN as RUN_PART
from ..engine.schedules.lowering import WAIT as WAIT_PART
from ..engine.schedules.lowering import Op, step_end
from ..engine.schedules.lowering import lower as lower_actions
from ..engine.updates import update_build as U
from ..engine.updates import update_parts as P
from ..engine.updates.collectives import Collective
from ..engine.updates.stepper import Stepper
from ..engine.updates.update import UpdatePart, UpdateShape
from .stage_costs import StageCosts, Timing, rank_costs  # noqa: F401  (what the simulator is given and returns)

COMPUTE, SEND, POST, RECV, ISSUE, WAIT, WAIT_SENDS, MARK = range(8)


def _reads(costs: StageCosts) -> float:
    return costs.read_gradients


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

    def segment(self, step: int) -> None:
        mine, ops, dispatch, costs = self.mine, self.ops, self.mine.dispatch, self.costs
        split = self.layout.mode.splits_backward
        d = self.layout.num_stages
        for code, op, first, second in _segment_plan(self.layout, self.stage, step, mine.shape):
            if dispatch:
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
            elif code == _RECV:
                ops.append(first)
            elif code == _WAIT_SENDS:
                ops.append((WAIT_SENDS,))
            elif code == _LOSS:
                self.loss[op.batch] = self.issue(*self.group("loss"), 0.0)  # a scalar: its latency
            else:
                self.update(op)

    def take_loss(self, batch: int) -> None:
        if batch in self.loss:
            self.wait(self.loss.pop(batch))


CollectiveCost = Callable[[int, Collective], float]  # (stage, declared collective) -> seconds of one issue


_FORWARD, _BACKWARD, _WEIGHT, _SEND, _RECV, _WAIT_SENDS, _LOSS, _UPDATE = range(8)


@functools.lru_cache(maxsize=4096)
def _segment_plan(layout: Layout, stage: int, step: int, shape: UpdateShape) -> tuple:
    """The lowered ops of ``stage``'s segment of ``step`` (``lowering.lower``), each as ``(code, op, first,
    second)`` with what needs no cost worked out once (a message's link and name, its posted receive): the
    schedule's, not the costs', so the candidates that differ only in costs (placement, gradients, recomputation,
    the cluster) share them."""
    plan = []
    d = layout.num_stages
    virtual = d * layout.virtual_stages  # a message is named by its sender's virtual stage (one chunk a rank: the rank)
    for op in lower_actions(S.segment(layout, stage, step), U.collectives(shape), layout.num_microbatches):
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
        elif kind == S.RECV_FORWARD:
            code, first = _RECV, (RECV, (here - 1, S.SEND_FORWARD, micro))
        elif kind == S.RECV_BACKWARD:
            code, first = _RECV, (RECV, (here + 1, S.SEND_BACKWARD, micro))
        else:
            codes = {S.FORWARD: _FORWARD, S.BACKWARD: _BACKWARD, S.WEIGHT: _WEIGHT, S.WAIT_SENDS: _WAIT_SENDS}
            code = _LOSS if kind == S.LOSS else codes.get(kind, _UPDATE)
        plan.append((code, op, first, second))
    return tuple(plan)


def lower(layout: Layout, costs: Sequence[StageCosts], cost_of: CollectiveCost, steps: int) -> list[list[tuple]]:
    """Every stage's timed operations for ``steps`` training steps, as the strategy drives them."""
    programs = []
    for stage in range(layout.num_stages):
        lowering = _Lowering(layout, stage, costs, cost_of)
        sigterm = None
        for step in range(steps):
            if sigterm is not None:
                lowering.wait(sigterm)
            sigterm = lowering.issue("world", tuple(range(layout.num_stages)), 0.0)
            if costs[stage].per_step:
                lowering.ops.append((COMPUTE, costs[stage].per_step))
            lowering.segment(step)
            end = step_end(layout.mode, step)
            if end.wait_sends:
                lowering.ops.append((WAIT_SENDS,))
            lowering.take_loss(end.loss_of)
            lowering.ops.append((MARK, step))
        programs.append(lowering.ops)
    return programs


class Stuck(RuntimeError):
    """No stage can go on: the lowering waits for something no stage issues (a bug in the lowering)."""


def run(programs: list[list[tuple]]) -> tuple[list[list[float]], list[list[float]], list[list[float]]]:
    """Run the stages' operations; per stage, the time at each step's end, and per step the time blocked on the
    update's collectives and the compute."""
    d = len(programs)
    clock = [0.0] * d
    at = [0] * d
    marks: list[list[float]] = [[] for _ in range(d)]
    exposed: list[list[float]] = [[0.0] for _ in range(d)]
    busy: list[list[float]] = [[0.0] for _ in range(d)]
    sent: dict[tuple, tuple[float, float]] = {}  # message -> (sent at, seconds on the link)
    posted: dict[tuple, float] = {}
    arrived: dict[tuple, float] = {}
    links: dict[tuple[int, int], list[tuple]] = {}  # link -> its messages in send order
    link_done: dict[tuple[int, int], int] = {}  # link -> messages delivered so far
    link_free: dict[tuple[int, int], float] = {}
    mine: list[list[tuple]] = [[] for _ in range(d)]  # each stage's messages sent
    issues: dict[tuple[str, int], dict[int, tuple[float, float]]] = {}  # collective -> member -> (issued, seconds)
    members_of: dict[tuple[str, int], tuple[int, ...]] = {}
    ended: dict[str, list[float]] = {}  # channel -> the end of each collective on it, in issue order

    def deliver(link: tuple[int, int]) -> None:
        queue, done = links.get(link, []), link_done.get(link, 0)
        while done < len(queue) and queue[done] in posted:
            message = queue[done]
            at_, seconds = sent[message]
            arrived[message] = max(at_, posted[message], link_free.get(link, 0.0)) + seconds
            link_free[link] = arrived[message]
            done += 1
        link_done[link] = done

    def end_of(handle: tuple[str, int]) -> float | None:
        """When collective ``handle`` ends, once it and every one before it on its communicator can be timed."""
        channel, number = handle
        while ended.get(channel, ()).__len__() <= number:
            done = ended.setdefault(channel, [])
            members, issued = members_of.get((channel, len(done))), issues.get((channel, len(done)), {})
            if members is None or len(issued) < len(members):
                return None
            previous = done[-1] if done else 0.0
            done.append(max(previous, *(t for t, _ in issued.values())) + max(s for _, s in issued.values()))
        return ended[channel][number]

    def step(stage: int, op: tuple) -> bool:
        t = clock[stage]
        code = op[0]
        if code == COMPUTE:
            clock[stage] = t + op[1]
            busy[stage][-1] += op[1]
        elif code == SEND:
            _, link, message, seconds = op
            sent[message] = (t, seconds)
            links.setdefault(link, []).append(message)
            mine[stage].append(message)
            deliver(link)
        elif code == POST:
            posted.setdefault(op[1], t)
            deliver((op[1][0] % d, stage))  # a message names its sender's (virtual) stage
        elif code == RECV:
            message = op[1]
            posted.setdefault(message, t)
            if message in sent:
                deliver((message[0] % d, stage))
            if message not in arrived:
                return False
            clock[stage] = max(t, arrived[message])
        elif code == WAIT_SENDS:
            if any(message not in arrived for message in mine[stage]):
                return False
            clock[stage] = max([t, *(arrived[m] for m in mine[stage])])
            mine[stage].clear()
        elif code == ISSUE:
            _, channel, number, members, seconds = op
            handle = (channel, number)
            members_of[handle] = members
            issues.setdefault(handle, {})[stage] = (t, seconds)
        elif code == WAIT:
            end = end_of((op[1], op[2]))
            if end is None:
                return False
            clock[stage] = max(t, end)
            if op[3]:
                exposed[stage][-1] += clock[stage] - t
        elif code == MARK:
            marks[stage].append(t)
            exposed[stage].append(0.0)
            busy[stage].append(0.0)
        return True

    while any(at[s] < len(programs[s]) for s in range(d)):
        progressed = False
        for stage in range(d):
            program, i, length, spent = programs[stage], at[stage], len(programs[stage]), busy[stage]
            while i < length:
                op = program[i]
                if op[0] == COMPUTE:  # the most frequent, inline
                    clock[stage] += op[1]
                    spent[-1] += op[1]
                elif not step(stage, op):
                    break
                elif op[0] == MARK:
                    spent = busy[stage]
                i += 1
            progressed = progressed or i != at[stage]
            at[stage] = i
        if not progressed:
            waiting = {s: programs[s][at[s]] for s in range(d) if at[s] < len(programs[s])}
            raise Stuck(f"no stage can go on; each waits at {waiting}")
    return marks, exposed, busy


SIMULATED_MICROBATCHES = 32  # per stage and more: beyond, the steady state's period is added per microbatch


def simulate(layout: Layout, costs: Sequence[StageCosts], cost_of: CollectiveCost, steps: int | None = None) -> Timing:
    """The steady-state step of ``layout`` with ``costs`` per stage (interleaved: per virtual stage, ``d x V``;
    ``cost_of``: seconds of one declared collective of a stage, by rank). 2BW's first two steps fill the pipeline and are left out; flush's steps are all alike.

    Beyond ``max(2 d, SIMULATED_MICROBATCHES)`` microbatches the batch is simulated at that many and each further
    microbatch adds the steady state's period, the slowest stage's forward and backward (or its link's message,
    where longer): 1F1B's steady state repeats it, and the update's collectives only gain cover with more
    microbatches, so what was exposed at the simulated count is an upper bound."""
    m, d = layout.num_microbatches, layout.num_stages
    simulated = max(2 * d, SIMULATED_MICROBATCHES)
    if layout.virtual_stages > 1:  # interleaved: whole rounds of d (its order depends on m // d otherwise)
        simulated = -(-simulated // d) * d
    if m <= simulated or (layout.virtual_stages > 1 and m % d):
        return _simulate(layout, costs, cost_of, steps)
    timing = _simulate(dataclasses.replace(layout, num_microbatches=simulated), costs, cost_of, steps)
    ranks = [rank_costs(costs, layout, r) for r in range(d)]
    period = max(max(c.forward + c.backward, c.send) for c in ranks)
    extra = (m - simulated) * period
    busy = tuple(b + (m - simulated) * (c.forward + c.backward) for b, c in zip(timing.busy, ranks))
    return dataclasses.replace(timing, step_time=timing.step_time + extra, busy=busy)


def _simulate(layout: Layout, costs: Sequence[StageCosts], cost_of: CollectiveCost, steps: int | None) -> Timing:
    double = layout.mode.double_buffered
    steps = steps or (4 if double else 1)
    marks, exposed, busy = run(lower(layout, costs, cost_of, steps))
    ends = [max(marks[s][k] for s in range(layout.num_stages)) for k in range(steps)]
    first = 2 if double and steps > 3 else 0
    start = ends[first - 1] if first else 0.0
    counted = steps - first
    per_step = (ends[-1] - start) / counted
    ranks = [rank_costs(costs, layout, r) for r in range(layout.num_stages)]
    update_compute = [
        sum(PART_COMPUTE[part][1](c) for part in U.choose_parts(c.shape) if part in PART_COMPUTE) for c in ranks
    ]
    return Timing(
        per_step,
        tuple(sum(e[first:steps]) / counted for e in exposed),
        tuple(sum(b[first:steps]) / counted for b in busy),
        tuple(update_compute),
    )
