"""The ring's messages in lockstep (interleaved 1F1B, its evaluation): every rank's computes placed on one clock, and
at each tick one batch per rank holding the sends of what the rank computed then and the receives of what its
neighbours computed then, closed by ``TICK``.

Why: on a ring each pair of ranks exchanges both directions, and a rank's chunks receive from its previous rank at
points its own order fixes, so no rule local to one rank (1F1B's, a send batched with the next receive from the same
peer: ``actions.fuse_receives``) keeps NCCL's matching in issue order free of a wait cycle (an experiment under
``verify/nccl_model.py`` found one at 28 of 40 shapes). torch's ``PipelineScheduleMulti`` and Megatron-LM's interleaved
schedule run this way: one ``batch_isend_irecv`` per time step (the step's sends and the neighbours' matching
receives). A batch of tick t then meets only batches of tick t, on one communicator (the ring's group: batched
point-to-point runs on a group's own communicator), each issued once the rank's computes of tick t are: no wait
cycle, whether kernels of different communicators run together or one at a time (``tests/unit/test_lockstep.py``
proves it under the NCCL model). A batch is waited for where a compute reads what it received (``StageLink.arrived``).

The clock is the greedy one a rank's own waits make: a rank runs its next tick's computes at the first tick after every
input they read from another rank was computed (forward: the previous virtual stage's forward; backward: the next
one's backward). A tick holds one forward in the warm-up, one backward in the cool-down and, in between, a forward and
the backward after it (``pairs``: Megatron-LM's steady state), so neighbours' ticks take about as long and no rank
waits at a tick for a longer compute than its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from .actions import BACKWARD, EVAL, FORWARD, RECEIVES, TICK, Action, Kind

Unit = tuple[Sequence[Action], Action, Sequence[Action]]  # one compute: its receives, itself, its sends

__all__ = ["TICK", "Unit", "lockstep", "pairs", "unit_of"]


def _input_of(compute: Action, virtual: int, last: int) -> tuple[Kind, int, int] | None:
    """The (kind, microbatch, virtual stage) whose output ``compute`` (on ``virtual``) reads from another rank."""
    if compute.kind in (FORWARD, EVAL) and virtual > 0:
        return compute.kind, compute.microbatch, virtual - 1
    if compute.kind == BACKWARD and virtual < last:
        return BACKWARD, compute.microbatch, virtual + 1
    return None


def lockstep(steps: Sequence[Sequence[Sequence[Unit]]], virtual_stages: int, batch: int) -> list[list[Action]]:
    """Every rank's actions: ``steps[r]`` (rank r's computes in its order, grouped into the ones a tick runs together,
    each with the messages of its virtual stage ``chunk x d + r``) on one clock; after each tick where a rank sends
    or receives, its batch (sends first) and ``TICK(batch)``. Raises where the orders wait on one another."""
    d = len(steps)
    last = d * virtual_stages - 1
    receives_of: dict[tuple[Kind, int, int], Sequence[Action]] = {}
    for rank, rank_steps in enumerate(steps):
        for receives, compute, _ in (unit for step in rank_steps for unit in step):
            receives_of[(compute.kind, compute.microbatch, compute.chunk * d + rank)] = receives
    done: set[tuple[Kind, int, int]] = set()
    position = [0] * d
    lists: list[list[Action]] = [[] for _ in range(d)]
    while any(position[r] < len(steps[r]) for r in range(d)):
        ran = [
            rank
            for rank in range(d)
            if position[rank] < len(steps[rank])
            and all(
                needs is None or needs in done
                for needs in (_input_of(u[1], u[1].chunk * d + rank, last) for u in steps[rank][position[rank]])
            )
        ]
        if not ran:
            waiting = {
                r: " ".join(str(u[1]) for u in steps[r][position[r]]) for r in range(d) if position[r] < len(steps[r])
            }
            raise ValueError(f"the ranks' orders wait on one another (each rank's next computes: {waiting})")
        sends: list[list[Action]] = [[] for _ in range(d)]
        receives: list[list[Action]] = [[] for _ in range(d)]
        for rank in ran:
            for _, compute, sent in steps[rank][position[rank]]:
                virtual = compute.chunk * d + rank
                lists[rank].append(compute)
                done.add((compute.kind, compute.microbatch, virtual))
                if sent:
                    sends[rank] += sent
                    consumer = virtual - 1 if compute.kind == BACKWARD else virtual + 1
                    receives[consumer % d] += receives_of[(compute.kind, compute.microbatch, consumer)]
            position[rank] += 1
        for rank in range(d):
            if sends[rank] or receives[rank]:
                lists[rank] += [*sends[rank], *receives[rank], Action(TICK, batch)]
    return lists


def pairs(units: Sequence[Unit], warmup: int) -> list[tuple[Unit, ...]]:
    """A 1F1B order's computes grouped into ticks as Megatron-LM's interleaved schedule runs them: each warm-up
    forward alone, then each forward with the backward after it, then each cool-down backward alone; in the steady
    state a tick so holds a forward and a backward on every rank, and no rank waits at a tick for a neighbour's
    longer compute."""
    grouped: list[tuple[Unit, ...]] = [(unit,) for unit in units[:warmup]]
    index = warmup
    while index + 1 < len(units) and units[index][1].kind != BACKWARD and units[index + 1][1].kind == BACKWARD:
        grouped.append((units[index], units[index + 1]))
        index += 2
    return grouped + [(unit,) for unit in units[index:]]


def unit_of(expanded: Sequence[Action]) -> Unit:
    """One compute's actions as ``schedule._forward`` / ``_backward`` expand them, split around the compute."""
    index = next(i for i, action in enumerate(expanded) if action.kind not in RECEIVES)
    return expanded[:index], expanded[index], expanded[index + 1 :]
