"""The planner's clock: the engine's own per-stage programs, timed.

``simulate`` lowers what every stage of one pipeline replica runs for a few training steps into timed operations and
runs them: each step's program (``program.train_step``: the segment, its fused receives, the stop agreement at its
head, the loss it takes, 2BW's synchronous start drained), the update's parts with the collectives each declares
(``update_build.collectives``: what ``verify/comm_plan.py`` lowers for the NCCL model). Dependencies are the engine's:

- an operation starts when the one before it on its stage is done (compute: a forward, a backward with its
  recomputation, the optimizer's step, the gradients read for the norm and the flags);
- a message travels once it is sent and its receive is posted (at the receive, or earlier at the send it is
  batched with), one at a time per link and direction, in ``latency + bytes / bandwidth``; a receive waits for it;
  a drain (``WAIT_SENDS``) waits for every message its stage sent;
- a collective starts when every member has issued it and the one before it on its communicator is done; a part
  that waits for it blocks its stage until it ends. Replicas run alike, so a replica group's collective starts as
  soon as its stage issues it.

The step time is the steady state's (2BW: after its first two steps; ``sync_steps``: the start's steps instead);
``exposed`` is, per stage, the time a step spends blocked on the update's collectives. Costs come from ``cost.py``
(``StageCosts``); the simulator knows no formula of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..engine.layout import Layout
from .stage_costs import StageCosts, Timing, rank_costs  # noqa: F401  (what the simulator is given and returns)
from .timed_program import (  # noqa: F401  (the operations it runs; the lowering and its costs re-exported)
    COMPUTE,
    DELIVERED,
    ISSUE,
    MARK,
    PART_COMPUTE,
    POST,
    RECV,
    SEND,
    WAIT,
    WAIT_SENDS,
    CollectiveCost,
    lower,
)


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
        elif code == DELIVERED:
            if op[1] not in arrived:
                return False
            clock[stage] = max(t, arrived[op[1]])
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


def simulate(
    layout: Layout,
    costs: Sequence[StageCosts],
    cost_of: CollectiveCost,
    steps: int | None = None,
    synchronous: bool = False,
) -> Timing:
    """The steady-state step of ``layout`` with ``costs`` per stage (interleaved: per virtual stage, ``d x V``;
    ``cost_of``: seconds of one declared collective of a stage, by rank). 2BW's first two steps fill the pipeline and
    are left out; flush's steps are all alike; ``synchronous``: a step of 2BW's synchronous start (each drained).

    Beyond ``max(2 d, SIMULATED_MICROBATCHES)`` microbatches the batch is simulated at that many and each further
    microbatch adds the steady state's period, the slowest stage's forward and backward (or its link's message,
    where longer): 1F1B's steady state repeats it, and the update's collectives only gain cover with more
    microbatches, so what was exposed at the simulated count is an upper bound."""
    m, d = layout.num_microbatches, layout.num_stages
    simulated = max(2 * d, SIMULATED_MICROBATCHES)
    if layout.virtual_stages > 1:  # interleaved: whole rounds of d (its order depends on m // d otherwise)
        simulated = -(-simulated // d) * d
    if m <= simulated or (layout.virtual_stages > 1 and m % d):
        return _simulate(layout, costs, cost_of, steps, synchronous)
    timing = _simulate(dataclasses.replace(layout, num_microbatches=simulated), costs, cost_of, steps, synchronous)
    ranks = [rank_costs(costs, layout, r) for r in range(d)]
    period = max(max(c.forward + c.backward, c.send) for c in ranks)
    extra = (m - simulated) * period
    busy = tuple(b + (m - simulated) * (c.forward + c.backward) for b, c in zip(timing.busy, ranks))
    return dataclasses.replace(timing, step_time=timing.step_time + extra, busy=busy)


def without_update_compute(costs: Sequence[StageCosts]) -> list[StageCosts]:
    """``costs`` with the update's compute (the optimizer's step, the gradient reads) free."""
    return [dataclasses.replace(c, step=0.0, read_gradients=0.0) for c in costs]


def update_added(layout: Layout, costs: Sequence[StageCosts], cost_of: CollectiveCost, step_time: float) -> float:
    """What the update (its collectives, the optimizer's step, the gradient reads) adds to ``step_time``, the step
    simulated with ``costs``: that step less the same step with the update free. A stage's wait for the others inside
    the update (the global norm while they finish their cool-down) counts only where it delays the step."""
    bare = simulate(layout, without_update_compute(costs), lambda stage, collective: 0.0)
    return max(0.0, step_time - bare.step_time)


def _simulate(
    layout: Layout, costs: Sequence[StageCosts], cost_of: CollectiveCost, steps: int | None, synchronous: bool
) -> Timing:
    double = layout.mode.double_buffered and not synchronous  # the start's steps drain: all alike
    steps = steps or (4 if double else 1)
    marks, exposed, busy = run(lower(layout, costs, cost_of, steps, steps if synchronous else 0))
    ends = [max(marks[s][k] for s in range(layout.num_stages)) for k in range(steps)]
    first = 2 if double and steps > 3 else 0
    start = ends[first - 1] if first else 0.0
    counted = steps - first
    per_step = (ends[-1] - start) / counted
    return Timing(
        per_step,
        tuple(sum(e[first:steps]) / counted for e in exposed),
        tuple(sum(b[first:steps]) / counted for b in busy),
    )
