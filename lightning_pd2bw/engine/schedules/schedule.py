"""Pipeline schedules as data: pure functions that return one stage's list of actions.

A schedule never runs anything; the executor interprets it. Microbatch ids are global within a
"run" (the stretch between two drains): microbatch ``k`` belongs to batch ``k // num_microbatches``.
``weight_version`` on F/B actions counts optimizer updates since the last drain, so the version
rule of each mode is visible in the data and unit-testable without processes.

Modes (docs/2bw-vs-flush.md):
- ``flush``  (PipeDream-Flush): 1F1B, drain at the end of every batch, batch t uses version t.
- ``gpipe``: all forwards, then all backwards, drain every batch, batch t uses version t.
- ``zb_h1`` (zero-bubble H1, Qi et al. 2024, arXiv 2401.10241): Flush's 1F1B with each backward split into B (the
  input gradient, sent upstream at once) and W (the microbatch's deferred weight gradients); stage s holds its first s
  W back, then runs the oldest pending W after each B, and the held W fill the cooldown's bubble. Drained per batch,
  batch t uses version t (exact); the order is that of torch's ``ScheduleInterleavedZeroBubble`` with one stage per
  rank (``tests/unit/test_schedule_zb.py``).
- ``interleaved`` (Megatron-LM's interleaved 1F1B, Narayanan et al. 2021, arXiv 2104.04473): the model cut into
  d x V chunks, chunk ``v`` on rank ``v % d``; each rank runs its chunks' forwards in rounds of P microbatches (chunk 0's
  round, chunk 1's, ...) and its backwards the other way round, 1F1B after a warm-up of ``(V - 1) P + 2 (d - 1 - r)``
  forwards; drained per batch, exact. The order of torch's ``ScheduleInterleaved1F1B`` (``tests/unit/test_schedule_
  interleaved.py``). The planner simulates it; the engine does not run it yet (``Mode.runs``).
- ``2bw``    (PipeDream-2BW): one continuous 1F1B stream over the batches, never drained between
  batches; batch t uses version ``max(t - 1, 0)``. The update of batch t is first read by batch t + 2's first
  forward, so it runs beside batch t + 1 (``update.py``): REDUCE(t) right after t's last backward on the stage
  (its gradients set aside, the tied sums launched); CHECK, HOOKS and NORM(t) (the clip norm launched over the
  pipeline) once batch t + 1's forward of microbatch ``(t + 1) m + w0`` has passed the stage (``w0``: the first
  stage's warm-up), by which every stage has reached REDUCE(t), so none waits for another's tied sum; CLIP and
  STEP(t) ``d - 1`` forwards later (every stage has launched the norm by then; ``finish_after``: where batch t + 1
  has no such forward, at the end of step t + 1), and PUBLISH(t) at the end of step t + 1, before batch t + 2's
  first forward reads W(t + 1): the sharded optimizer's broadcasts of the new weights run in between, behind batch
  t + 1's compute. A step's end therefore holds every update but the last batch's, whatever the layout. Flush and
  GPipe run the parts back to back at the end of their batch.

``segment(...)`` returns the actions of one training step (what the strategy runs per Lightning
step); ``drain(...)`` returns what is left in flight after a step; ``stream(...)`` is the
concatenation for a whole run, used by tests and the schedule picture.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from ..layout import MODES, Layout, Mode
from .actions import (  # noqa: F401  (the instruction set, re-exported: ``schedule.Action``, ``schedule.FORWARD``)
    BACKWARD,
    BATCH_KINDS,
    CHECK,
    CLIP,
    DRAINED,
    EVAL,
    EVAL_KINDS,
    EVAL_RESULTS,
    FINISH_PARTS,
    FLAG,
    FORWARD,
    HOOKS,
    LAST_FLAG,
    LOSS,
    NORM,
    PREPARE_PARTS,
    PUBLISH,
    RECEIVES,
    RECV_BACKWARD,
    RECV_FORWARD,
    REDUCE,
    RESTART,
    SEND_BACKWARD,
    SEND_FORWARD,
    SETTLE,
    SETUP_KINDS,
    SETUP_REPLICAS,
    SETUP_TIED,
    STEP,
    STEP_KINDS,
    TAKE_LOSS,
    TICK,
    TRAIN_KINDS,
    UPDATE_KINDS,
    UPDATE_PARTS,
    WAIT_SENDS,
    WEIGHT,
    Action,
    Kind,
    fuse_receives,
    fused_receive,
    listing,
)
from .lockstep import lockstep, pairs, unit_of
from .placement import (  # noqa: F401  (where the update goes, re-exported)
    _insert_steps,
    finish,
    finish_after,
    prepare,
    prepare_after,
    update,
    warmup_forwards,
)

__all__ = ["MODES", "Action", "Kind", "drain", "evaluation", "listing", "segment", "stream", "update"]


def weight_version(mode: Mode, batch: int) -> int:
    """The version (updates since the last drain) that ``batch`` runs forward and backward on."""
    return max(batch - 1, 0) if mode.double_buffered else batch


def _forward(stage: int, num_stages: int, microbatch: int, num_microbatches: int, mode: Mode) -> list[Action]:
    batch = microbatch // num_microbatches
    version = weight_version(mode, batch)
    actions = []
    if stage > 0:
        actions.append(Action(RECV_FORWARD, batch, microbatch, version))
    actions.append(Action(FORWARD, batch, microbatch, version))
    if stage < num_stages - 1:
        actions.append(Action(SEND_FORWARD, batch, microbatch, version))
    return actions


def _backward(stage: int, num_stages: int, microbatch: int, num_microbatches: int, mode: Mode) -> list[Action]:
    batch = microbatch // num_microbatches
    version = weight_version(mode, batch)
    actions = []
    if stage < num_stages - 1:
        actions.append(Action(RECV_BACKWARD, batch, microbatch, version))
    actions.append(Action(BACKWARD, batch, microbatch, version))
    if stage > 0:
        actions.append(Action(SEND_BACKWARD, batch, microbatch, version))
    return actions


def _flush_order(
    stage: int, num_stages: int, num_microbatches: int, mode: Mode, batch: int, lookahead: int = 0
) -> list[tuple[str, int]]:
    """(kind, microbatch) order of one drained batch."""
    if mode.splits_backward:
        return _split_order(stage, num_stages, num_microbatches, batch)
    first = batch * num_microbatches
    ids = range(first, first + num_microbatches)
    if mode.forwards_first:
        return [(FORWARD, k) for k in ids] + [(BACKWARD, k) for k in ids]
    warmup = warmup_forwards(stage, num_stages, num_microbatches, lookahead)
    order = [(FORWARD, k) for k in ids[:warmup]]
    for i, k in enumerate(ids[warmup:]):
        order += [(FORWARD, k), (BACKWARD, ids[i])]
    order += [(BACKWARD, k) for k in ids[num_microbatches - warmup :]]
    return order


def _split_order(stage: int, num_stages: int, num_microbatches: int, batch: int) -> list[tuple[str, int]]:
    """(kind, microbatch) order of one ZB-H1 batch: 1F1B's forwards and backwards (B), each backward followed by the
    oldest pending W once ``stage`` of them are held back; the held W after the last backward."""
    first = batch * num_microbatches
    ids = range(first, first + num_microbatches)
    warmup = warmup_forwards(stage, num_stages, num_microbatches)
    order: list[tuple[str, int]] = [(FORWARD, k) for k in ids[:warmup]]
    pending: list[int] = []

    def backward(k: int) -> None:
        order.append((BACKWARD, k))
        pending.append(k)
        if len(pending) > stage:
            order.append((WEIGHT, pending.pop(0)))

    for i, k in enumerate(ids[warmup:]):
        order.append((FORWARD, k))
        backward(ids[i])
    for k in ids[num_microbatches - warmup :]:
        backward(k)
    return order + [(WEIGHT, k) for k in pending]


def _weight(stage: int, num_stages: int, microbatch: int, num_microbatches: int, mode: Mode) -> list[Action]:
    batch = microbatch // num_microbatches
    return [Action(WEIGHT, batch, microbatch, weight_version(mode, batch))]


def _expand(
    order: list[tuple[str, int]], stage: int, num_stages: int, num_microbatches: int, mode: Mode
) -> list[Action]:
    expand = {FORWARD: _forward, BACKWARD: _backward, WEIGHT: _weight}
    actions: list[Action] = []
    for kind, k in order:
        actions += expand[kind](stage, num_stages, k, num_microbatches, mode)
    return actions


def interleaved_warmup(rank: int, layout: Layout) -> int:
    """The forwards ``rank`` runs before its first backward in an interleaved 1F1B batch."""
    d, m, chunks = layout.num_stages, layout.num_microbatches, layout.virtual_stages
    return min((chunks - 1) * (m // max(1, m // d)) + 2 * (d - 1 - rank), chunks * m)


def interleaved_order(rank: int, layout: Layout, batch: int) -> list[tuple[str, int, int]]:
    """(kind, microbatch, chunk) order of one interleaved 1F1B batch on ``rank``: the rank's i-th forward runs chunk
    ``(i // P) % V`` on microbatch ``(i // (P V)) P + i % P`` (P microbatches a round, ``max(1, m // d)`` rounds),
    its i-th backward the same microbatch on chunk ``V - 1 - (i // P) % V``."""
    d, m, chunks = layout.num_stages, layout.num_microbatches, layout.virtual_stages
    per_round = m // max(1, m // d)
    first, ops = batch * m, chunks * m

    def nth(i: int, backward: bool) -> tuple[str, int, int]:
        chunk = (i // per_round) % chunks
        microbatch = first + (i // (per_round * chunks)) * per_round + i % per_round
        return (BACKWARD, microbatch, chunks - 1 - chunk) if backward else (FORWARD, microbatch, chunk)

    warmup = interleaved_warmup(rank, layout)
    order = [nth(i, False) for i in range(warmup)]
    for i in range(ops - warmup):
        order += [nth(warmup + i, False), nth(i, True)]
    return order + [nth(i, True) for i in range(ops - warmup, ops)]


def _interleaved(layout: Layout, rank: int, batch: int) -> list[Action]:
    """Interleaved 1F1B's actions of batch ``batch`` on ``rank``: each chunk's compute (virtual stage ``chunk x d +
    rank`` of ``d x V``: the first receives nothing, the last sends nothing on), its messages in the ring's lockstep
    (``lockstep.py``)."""
    return list(_interleaved_ranks(layout, batch)[rank])


@functools.lru_cache(maxsize=32)
def _interleaved_ranks(layout: Layout, batch: int) -> tuple[tuple[Action, ...], ...]:
    d, m = layout.num_stages, layout.num_microbatches
    virtual = d * layout.virtual_stages
    steps = []
    for rank in range(d):
        rank_units = []
        for kind, k, chunk in interleaved_order(rank, layout, batch):
            expand = _forward if kind == FORWARD else _backward
            expanded = [replace(a, chunk=chunk) for a in expand(chunk * d + rank, virtual, k, m, layout.mode)]
            rank_units.append(unit_of(expanded))
        steps.append(pairs(rank_units, interleaved_warmup(rank, layout)))
    return tuple(tuple(actions) for actions in lockstep(steps, layout.virtual_stages, batch))


def _twobw_order(
    stage: int, num_stages: int, num_microbatches: int, batch: int, lookahead: int = 0
) -> list[tuple[str, int]]:
    """(kind, microbatch) order of step ``batch`` in the continuous 2BW stream.

    Step ``batch`` owns the forwards of its own microbatches; the backwards interleaved with them
    trail by the stage's warm-up depth, so they may belong to the previous batch.
    """
    warmup = warmup_forwards(stage, num_stages, num_microbatches, lookahead)
    order: list[tuple[str, int]] = []
    first = batch * num_microbatches
    for k in range(first, first + num_microbatches):
        order.append((FORWARD, k))
        if k - warmup >= 0:
            order.append((BACKWARD, k - warmup))
    return order


def _pending_before(
    mode: Mode, stage: int, num_stages: int, num_microbatches: int, batch: int, lookahead: int = 0
) -> int | None:
    """The batch whose REDUCE is pending when step ``batch`` begins (2BW's last stage carries one over)."""
    if mode.flushes or batch == 0:
        return None
    return batch - 1 if warmup_forwards(stage, num_stages, num_microbatches, lookahead) == 0 else None


def _segment(
    mode: Mode, stage: int, num_stages: int, num_microbatches: int, batch: int, lookahead: int = 0
) -> list[Action]:
    """Actions of training step ``batch`` (0-based since the last drain) on ``stage``; the raw list: ``segment``
    moves a trailing SEND_B to the next segment."""
    if mode.flushes:
        order = _flush_order(stage, num_stages, num_microbatches, mode, batch, lookahead)
        return _expand(order, stage, num_stages, num_microbatches, mode) + update(batch) + [Action(WAIT_SENDS, batch)]
    order = _twobw_order(stage, num_stages, num_microbatches, batch, lookahead)
    actions = _expand(order, stage, num_stages, num_microbatches, mode)
    pending = _pending_before(mode, stage, num_stages, num_microbatches, batch, lookahead)
    after = finish_after(num_stages, num_microbatches, lookahead)
    actions, _ = _insert_steps(
        actions, num_microbatches, pending, prepare_after(num_stages, num_microbatches, lookahead), after
    )
    return actions


def _completion(layout: Layout, batch: int) -> list[Action]:
    """The end of step ``batch``'s compute under 2BW: PUBLISH(b - 1), after CLIP and STEP(b - 1) where the step had no
    room for them beside its forwards (``finish_after`` None)."""
    _, num_stages, num_microbatches, lookahead = _of(layout)
    if batch < 1:
        return []
    fits = finish_after(num_stages, num_microbatches, lookahead) is not None
    return [*([] if fits else finish(batch - 1)), Action(PUBLISH, batch - 1)]


def _carried(actions: list[Action]) -> tuple[list[Action], list[Action]]:
    """A 2BW segment's trailing SEND_B, split off: it goes out at the head of the next segment (or drain)."""
    if actions and actions[-1].kind == SEND_BACKWARD:
        return actions[:-1], actions[-1:]
    return actions, []


def segment(layout: Layout, stage: int, batch: int) -> list[Action]:
    """Actions of training step ``batch`` (0-based since the last drain) on ``stage`` of ``layout``.

    Under 2BW step ``batch`` completes batch ``batch - 1``'s update (CLIP and STEP at ``finish_after``, or at its end
    where it has no room; PUBLISH at its end: before the next batch's first forward reads the weights it makes), and
    batch b's REDUCE follows its last backward on this stage.
    A segment's last action on a stage after the first is a SEND_B whose neighbour takes it only in its next
    segment, fused with the first activations of the next batch (``fused_receive``): it is sent at the head of the
    next segment (or drain), in one batch with the receive of those activations, so both ends of the pair batch
    the same two messages. Every segment ends with ``LOSS(batch)``: the last stage's broadcast of the batch's mean
    loss to its pipeline, on a group of its own."""
    mode, num_stages, num_microbatches, lookahead = _of(layout)
    if mode.interleaved:
        return [*_interleaved(layout, stage, batch), *update(batch), Action(WAIT_SENDS, batch), Action(LOSS, batch)]
    raw = _segment(mode, stage, num_stages, num_microbatches, batch, lookahead)
    if mode.flushes:
        return [*raw, Action(LOSS, batch)]
    actions, _ = _carried(raw)
    if batch == 0:
        return [*actions, Action(LOSS, batch)]
    _, carried = _carried(_segment(mode, stage, num_stages, num_microbatches, batch - 1, lookahead))
    return [*carried, *actions, *_completion(layout, batch), Action(LOSS, batch)]


def drain(layout: Layout, stage: int, last_batch: int) -> list[Action]:
    """What remains in flight on ``stage`` after step ``last_batch``: its last backwards and its whole update (nothing
    may stay pending after a drain), then the wait for its sends."""
    mode, num_stages, num_microbatches, lookahead = _of(layout)
    if mode.flushes or last_batch < 0:
        return []
    warmup = warmup_forwards(stage, num_stages, num_microbatches, lookahead)
    end = (last_batch + 1) * num_microbatches
    order = [(BACKWARD, k) for k in range(end - warmup, end)]
    actions = _expand(order, stage, num_stages, num_microbatches, mode)
    _, carried = _carried(_segment(mode, stage, num_stages, num_microbatches, last_batch, lookahead))
    # the previous step may have left this stage's REDUCE of `last_batch` pending (warm-up 0)
    return carried + actions + update(last_batch) + [Action(WAIT_SENDS, last_batch)]


def evaluation(stage: int, num_stages: int, num_microbatches: int, virtual_stages: int = 1) -> list[Action]:
    """An evaluation's (or prediction's) actions on ``stage``: each microbatch received from the stage before (past
    the first), run forward-only on the newest weights, sent on (before the last); then the sends waited for. No
    weight version: evaluation follows a drain. Interleaved 1F1B (``virtual_stages`` > 1): chunk by chunk, each
    microbatch through the chunk's virtual stage, the ring's messages in lockstep (``lockstep.py``); last, the results sent from the last stage to every stage
    (``EVAL_RESULTS``). The executor (``StageExecutor.evaluate``) and the NCCL lowering (``verify/comm_plan.py``)
    both run this list."""
    last = num_stages * virtual_stages - 1
    units: list[list] = []
    for rank in range(num_stages) if virtual_stages > 1 else [stage]:
        units.append([])
        for chunk in range(virtual_stages):
            virtual = chunk * num_stages + rank
            for microbatch in range(num_microbatches):
                receive = [Action(RECV_FORWARD, 0, microbatch, chunk=chunk)] if virtual > 0 else []
                send = [Action(SEND_FORWARD, 0, microbatch, chunk=chunk)] if virtual < last else []
                units[-1].append((receive, Action(EVAL, 0, microbatch, chunk=chunk), send))
    if virtual_stages > 1:  # the ring's messages in lockstep (``lockstep.py``), a forward a tick
        actions = lockstep([[(unit,) for unit in rank_units] for rank_units in units], virtual_stages, 0)[stage]
    else:
        actions = [action for receive, compute, send in units[0] for action in (*receive, compute, *send)]
    return actions + [Action(WAIT_SENDS, 0), Action(EVAL_RESULTS, 0)]


def stream(layout: Layout, stage: int, num_batches: int) -> list[Action]:
    """All actions of ``num_batches`` steps followed by the drain: one run between two drains."""
    actions: list[Action] = []
    for batch in range(num_batches):
        actions += segment(layout, stage, batch)
    return actions + drain(layout, stage, num_batches - 1)


def _of(layout: Layout) -> tuple[Mode, int, int, int]:
    """The layout's schedule facts (a ``Layout`` is valid by construction: nothing is checked per step)."""
    return layout.mode, layout.num_stages, layout.num_microbatches, layout.lookahead
