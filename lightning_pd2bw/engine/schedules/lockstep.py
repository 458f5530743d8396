"""The ring's messages in lockstep (interleaved 1F1B, its evaluation): every rank's compute placed on one clock, and at
each tick one batch per rank holding the sends of what the rank computed then and the receives of what its neighbours
computed then, closed by ``TICK``.

Why: on a ring each pair of ranks exchanges both directions, and a rank's chunks receive from its previous rank at
points its own order fixes, so no rule local to one rank (1F1B's, a send batched with the next receive from the same
peer: ``actions.fuse_receives``) keeps NCCL's matching in issue order free of a wait cycle (an experiment under
``verify/nccl_model.py`` found one at 28 of 40 shapes). torch's ``PipelineScheduleMulti`` runs its multi-stage
schedules this way: its schedule aligned on time steps, one ``batch_isend_irecv`` per step (the step's sends and the
neighbours' matching receives), waited for before the next step. A batch at tick t then meets only batches of tick t,
issued once every rank's tick t - 1 completed, on one communicator (the ring's group: batched point-to-point runs on
a group's own communicator): no cycle, whether kernels of different communicators run together or one at a time
(``tests/unit/test_lockstep.py`` proves it under the NCCL model).

The clock is the greedy one a rank's own waits make: a rank runs its next compute at the first tick after the tick its
input was computed at (forward: the previous virtual stage's forward; backward: the next one's backward), else idles
that tick.
"""

from __future__ import annotations

from collections.abc import Sequence

from .actions import BACKWARD, EVAL, FORWARD, RECEIVES, TICK, Action, Kind

Unit = tuple[Sequence[Action], Action, Sequence[Action]]  # one compute: its receives, itself, its sends

__all__ = ["TICK", "Unit", "lockstep", "unit_of"]


def _input_of(compute: Action, virtual: int, last: int) -> tuple[Kind, int, int] | None:
    """The (kind, microbatch, virtual stage) whose output ``compute`` (on ``virtual``) reads from another rank."""
    if compute.kind in (FORWARD, EVAL) and virtual > 0:
        return compute.kind, compute.microbatch, virtual - 1
    if compute.kind == BACKWARD and virtual < last:
        return BACKWARD, compute.microbatch, virtual + 1
    return None


def lockstep(units: Sequence[Sequence[Unit]], virtual_stages: int, batch: int) -> list[list[Action]]:
    """Every rank's actions: ``units[r]`` (rank r's computes in its order, each with the messages of its virtual stage
    ``chunk x d + r``) on one clock; after each tick where a rank sends or receives, its batch (sends first) and
    ``TICK(batch)``. Raises where the orders wait on one another."""
    d = len(units)
    last = d * virtual_stages - 1
    receives_of: dict[tuple[Kind, int, int], Sequence[Action]] = {}
    for rank, rank_units in enumerate(units):
        for receives, compute, _ in rank_units:
            receives_of[(compute.kind, compute.microbatch, compute.chunk * d + rank)] = receives
    done: set[tuple[Kind, int, int]] = set()
    position = [0] * d
    lists: list[list[Action]] = [[] for _ in range(d)]
    while any(position[r] < len(units[r]) for r in range(d)):
        ran = []
        for rank in range(d):
            if position[rank] == len(units[rank]):
                continue
            unit = units[rank][position[rank]]
            virtual = unit[1].chunk * d + rank
            needs = _input_of(unit[1], virtual, last)
            if needs is None or needs in done:
                ran.append((rank, unit, virtual))
        if not ran:
            waiting = {r: str(units[r][position[r]][1]) for r in range(d) if position[r] < len(units[r])}
            raise ValueError(f"the ranks' orders wait on one another (each rank's next compute: {waiting})")
        sends: list[list[Action]] = [[] for _ in range(d)]
        receives: list[list[Action]] = [[] for _ in range(d)]
        for rank, (_, compute, sent), virtual in ran:
            lists[rank].append(compute)
            done.add((compute.kind, compute.microbatch, virtual))
            position[rank] += 1
            if sent:
                sends[rank] += sent
                consumer = virtual - 1 if compute.kind == BACKWARD else virtual + 1
                receives[consumer % d] += receives_of[(compute.kind, compute.microbatch, consumer)]
        for rank in range(d):
            if sends[rank] or receives[rank]:
                lists[rank] += [*sends[rank], *receives[rank], Action(TICK, batch)]
    return lists


def unit_of(expanded: Sequence[Action]) -> Unit:
    """One compute's actions as ``schedule._forward`` / ``_backward`` expand them, split around the compute."""
    index = next(i for i, action in enumerate(expanded) if action.kind not in RECEIVES)
    return expanded[:index], expanded[index], expanded[index + 1 :]
