"""Pipeline schedules as data: pure functions that return one stage's list of actions.

A schedule never runs anything; the executor interprets it. Microbatch ids are global within a
"run" (the stretch between two drains): microbatch ``k`` belongs to batch ``k // num_microbatches``.
``weight_version`` on F/B actions counts optimizer updates since the last drain, so the version
rule of each mode is visible in the data and unit-testable without processes.

Modes (docs/2bw-vs-flush.md):
- ``flush``  (PipeDream-Flush): 1F1B, drain at the end of every batch, batch t uses version t.
- ``gpipe``: all forwards, then all backwards, drain every batch, batch t uses version t.
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

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from .layout import MODES, Layout, Mode

__all__ = ["MODES", "Action", "Kind", "drain", "evaluation", "listing", "segment", "stream", "update"]


class Kind(str, Enum):
    """What an action does; its text form (``str``, traces, logs) is the value."""

    FORWARD = "F"
    BACKWARD = "B"
    SEND_FORWARD = "SEND_F"
    RECV_FORWARD = "RECV_F"
    SEND_BACKWARD = "SEND_B"
    RECV_BACKWARD = "RECV_B"
    # the update of batch b, in this order (what each part does: engine/update.py's docstring)
    REDUCE = "REDUCE"  # the update begins: the next weight version writable, the gradients set aside
    CHECK = "CHECK"  # the reductions waited for; the non-finite policy
    HOOKS = "HOOKS"  # the before-step hooks (Lightning: on_before_optimizer_step)
    NORM = "NORM"  # the global clip norm launched over the pipeline
    CLIP = "CLIP"  # clipping
    STEP = "STEP"  # the optimizers' step, the delay correction; the sharded optimizer's broadcasts launched
    PUBLISH = "PUBLISH"  # the new weights in place on every replica: the sharded optimizer's broadcasts waited for
    WAIT_SENDS = "WAIT_SENDS"  # a drain (and every flush batch) waits for its outstanding sends
    LOSS = "LOSS"  # the end of a training step: the batch's mean loss, broadcast from the last stage (asynchronous)
    EVAL = "EVAL"  # evaluation or prediction: one microbatch forward-only, on the newest weights (``evaluation``)

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


FORWARD, BACKWARD, STEP, PUBLISH = Kind.FORWARD, Kind.BACKWARD, Kind.STEP, Kind.PUBLISH
SEND_FORWARD, RECV_FORWARD = Kind.SEND_FORWARD, Kind.RECV_FORWARD
SEND_BACKWARD, RECV_BACKWARD = Kind.SEND_BACKWARD, Kind.RECV_BACKWARD
REDUCE, CHECK, HOOKS, NORM, CLIP = Kind.REDUCE, Kind.CHECK, Kind.HOOKS, Kind.NORM, Kind.CLIP
WAIT_SENDS, LOSS, EVAL = Kind.WAIT_SENDS, Kind.LOSS, Kind.EVAL
UPDATE_PARTS = (REDUCE, CHECK, HOOKS, NORM, CLIP)  # run by the update with STEP; REDUCE also makes a version
PREPARE_PARTS = (CHECK, HOOKS, NORM)  # 2BW: beside batch b + 1, once every stage has reached REDUCE(b)
FINISH_PARTS = (CLIP, STEP)  # the update's completion (2BW: beside batch b + 1 where it has room, ``finish_after``)
UPDATE_KINDS = (*UPDATE_PARTS, STEP, PUBLISH)  # every action of the update (``update.UpdateRule.handlers``)
BATCH_KINDS = (*UPDATE_KINDS, WAIT_SENDS, LOSS)  # actions of a whole batch: no microbatch, no version
TRAIN_KINDS = tuple(kind for kind in Kind if kind is not EVAL)  # what a training step's actions are made of
EVAL_KINDS = (RECV_FORWARD, EVAL, SEND_FORWARD, WAIT_SENDS)  # what an evaluation's actions are made of
_TEXT = re.compile(
    r"^(?:(?P<batch_kind>[A-Z_]+)\(b(?P<batch>\d+)\)|(?P<kind>[A-Z_]+)\(m(?P<microbatch>\d+)(?:,v(?P<version>\d+))?\))$"
)


@dataclass(frozen=True)
class Action:
    """One instruction for one stage. ``microbatch`` is -1 for a batch's actions (the update's parts, WAIT_SENDS)."""

    kind: Kind
    batch: int
    microbatch: int = -1
    weight_version: int = -1

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            object.__setattr__(self, "kind", Kind(self.kind))  # "F" or Kind.FORWARD; anything else raises

    def __str__(self) -> str:
        if self.kind in BATCH_KINDS:
            return f"{self.kind.value}(b{self.batch})"
        if self.weight_version < 0:  # evaluation: the newest weights
            return f"{self.kind.value}(m{self.microbatch})"
        return f"{self.kind.value}(m{self.microbatch},v{self.weight_version})"

    @classmethod
    def parse(cls, text: str, num_microbatches: int) -> Action:
        """The action ``str(action)`` wrote (its batch is ``microbatch // num_microbatches``)."""
        found = _TEXT.match(text.strip())
        if found is None or (found["kind"] not in (None, EVAL.value) and found["version"] is None):
            raise ValueError(f"{text!r} is not an action; e.g. 'F(m3,v1)', 'SEND_B(m0,v0)', 'STEP(b2)'")
        if found["batch"] is not None:
            return cls(Kind(found["batch_kind"]), int(found["batch"]))
        microbatch, version = int(found["microbatch"]), found["version"]
        return cls(
            Kind(found["kind"]), microbatch // num_microbatches, microbatch, -1 if version is None else int(version)
        )


def listing(actions: Sequence[Action], marked: int | None = None) -> str:
    """``actions`` as text, one line each, ``marked`` (an index) flagged: what a stage was running."""
    return "\n".join(
        f"{'>>' if i == marked else '  '} {i:4d} {action}{'   <- failed here' if i == marked else ''}"
        for i, action in enumerate(actions)
    )


RECEIVES = (Kind.RECV_FORWARD, Kind.RECV_BACKWARD)
_WITH_NEXT = (Kind.SEND_FORWARD, Kind.RECV_BACKWARD)  # the point-to-point actions with the next stage
_WITH_PREVIOUS = (Kind.SEND_BACKWARD, Kind.RECV_FORWARD)


def fused_receive(actions: Sequence[Action], index: int) -> Action | None:
    """The receive issued in one batch with the send ``actions[index]``: the next action exchanging with the same
    neighbour, when it is a receive (1F1B's ``SEND_F(k)`` then ``RECV_B(j)``; ``SEND_B(j)`` then ``RECV_F(k+1)``),
    else None. Stage r's ``{SEND_F(k), RECV_B(j)}`` then meets stage r+1's ``{SEND_B(j), RECV_F(k)}``: the batching
    Megatron-LM and ``torch.distributed.pipelining`` use, deadlock-free when kernels run one at a time
    (``transport.py``; proven by ``nccl_model`` over ``comm_plan``'s lowering)."""
    kind = actions[index].kind
    if kind not in (Kind.SEND_FORWARD, Kind.SEND_BACKWARD):
        raise ValueError(f"{actions[index]} is not a send")
    same_peer = _WITH_NEXT if kind == Kind.SEND_FORWARD else _WITH_PREVIOUS
    for action in actions[index + 1 :]:
        if action.kind in same_peer:
            return action if action.kind in RECEIVES else None
    return None


def fuse_receives(actions: Sequence[Action]) -> dict[int, Action]:
    """The pass both the executor and the NCCL verifier read: for each send in ``actions``, by its index, the receive
    issued in one batch with it (``fused_receive``), where there is one. One backward scan of the list."""
    fused: dict[int, Action] = {}
    ahead: dict[tuple[Kind, ...], Action | None] = {_WITH_NEXT: None, _WITH_PREVIOUS: None}  # the next exchange
    for index in range(len(actions) - 1, -1, -1):
        action = actions[index]
        if action.kind in (Kind.SEND_FORWARD, Kind.SEND_BACKWARD):
            peer = _WITH_NEXT if action.kind == Kind.SEND_FORWARD else _WITH_PREVIOUS
            following = ahead[peer]
            if following is not None and following.kind in RECEIVES:
                fused[index] = following
        for peer in (_WITH_NEXT, _WITH_PREVIOUS):
            if action.kind in peer:
                ahead[peer] = action
    return fused


def warmup_forwards(stage: int, num_stages: int, num_microbatches: int, lookahead: int = 0) -> int:
    """1F1B warm-up depth of ``stage``: forwards run before the first backward.

    ``lookahead`` more forwards in flight on every stage, the last included: one more stashed microbatch each, in
    exchange for slack between neighbours (1F1B's steady state has none: a stage's late backward is at once its
    neighbour's wait). The last stage takes the extra too: under NCCL a send completes only when its receive is
    posted, so an upstream stage can run ahead only if the last stage receives ahead; and with every stage one
    warm-up forward ahead of the next, each pair batches ``{SEND_F(k), RECV_B(j)}`` against ``{SEND_B(j),
    RECV_F(k)}`` (``fused_receive``), deadlock-free when kernels run one at a time (a last stage without the extra
    deadlocks there: ``tests/unit/test_nccl_model.py``). The same number on every stage, at most ``m - d``: stage 0's
    ``d - 1 + lookahead`` warm-up forwards stay below m, so every batch's last backward precedes the next batch's
    last forward: 2BW's version rule and its two versions hold unchanged (``tests/unit/test_schedule.py``)."""
    extra = max(0, min(lookahead, num_microbatches - num_stages))
    return min(num_stages - stage - 1, num_microbatches) + extra


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


def _expand(
    order: list[tuple[str, int]], stage: int, num_stages: int, num_microbatches: int, mode: Mode
) -> list[Action]:
    expand = {FORWARD: _forward, BACKWARD: _backward}
    actions: list[Action] = []
    for kind, k in order:
        actions += expand[kind](stage, num_stages, k, num_microbatches, mode)
    return actions


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


def update(batch: int) -> list[Action]:
    """The parts of batch ``batch``'s update, in order, back to back (flush, gpipe, and 2BW's drain)."""
    return [Action(REDUCE, batch), *prepare(batch), *finish(batch), Action(PUBLISH, batch)]


def prepare(batch: int) -> list[Action]:
    """What 2BW runs of batch ``batch``'s update beside batch ``batch + 1``: the check, the hooks, the norm."""
    return [Action(kind, batch) for kind in PREPARE_PARTS]


def finish(batch: int) -> list[Action]:
    """The completion of batch ``batch``'s update: what 2BW runs beside batch ``batch + 1`` (``finish_after``) or at
    the end of step ``batch + 1``; PUBLISH ends that step."""
    return [Action(kind, batch) for kind in FINISH_PARTS]


def _insert_steps(
    actions: list[Action], num_microbatches: int, pending: int | None, prepare_after: int, finish_after: int | None
) -> tuple[list[Action], int | None]:
    """Place REDUCE(b), the beginning of batch b's update, right before the first F that follows b's last backward,
    its CHECK, HOOKS and NORM right after the forward of microbatch ``(b + 1) m + prepare_after`` and its send, and
    its CLIP and STEP after that of ``(b + 1) m + finish_after`` (None: not in this step).

    Returns the actions and the batch whose REDUCE is still pending at the end (or None).
    """
    out: list[Action] = []
    for index, action in enumerate(actions):
        if action.kind in (FORWARD, RECV_FORWARD) and pending is not None:
            out.append(Action(REDUCE, pending))
            pending = None
        out.append(action)
        if action.kind == BACKWARD and (action.microbatch + 1) % num_microbatches == 0:
            pending = action.batch
        sent = index + 1 == len(actions) or actions[index + 1].kind != SEND_FORWARD  # the forward's send is out
        if action.kind in (FORWARD, SEND_FORWARD) and sent and action.batch >= 1:
            position = action.microbatch % num_microbatches
            out += prepare(action.batch - 1) if position == prepare_after else []
            out += finish(action.batch - 1) if position == finish_after else []
    return out, pending


def prepare_after(num_stages: int, num_microbatches: int, lookahead: int = 0) -> int:
    """Under 2BW, CHECK, HOOKS and NORM of batch b run after the forward of microbatch ``(b + 1) m + prepare_after``
    on every stage: half a batch after REDUCE(b), so that the replica all-reduce of b's gradient buckets, started in
    b's last backward and waited for at CHECK, has half a batch of compute to hide behind (at 13B, 482 buckets of
    25 MiB over 16 replicas: about 0.5 s, where one forward is 45 ms); and never before the first stage's warm-up
    forwards, so that every stage has reached REDUCE(b) (the tied sum's members) when any stage waits at CHECK(b).
    The norm launched at NORM(b) then has ``d - 1`` forwards to complete before CLIP(b) reads it
    (``finish_after``)."""
    return max(warmup_forwards(0, num_stages, num_microbatches, lookahead), num_microbatches // 2)


def finish_after(num_stages: int, num_microbatches: int, lookahead: int = 0) -> int | None:
    """Under 2BW, CLIP and STEP of batch b run after the forward of microbatch ``(b + 1) m + finish_after``: ``d - 1``
    forwards after NORM(b) on the first stage, by which the last stage has run that forward too (1F1B puts it at
    most ``d - 1`` forwards behind the first), so CLIP(b) finds the pipeline's norm launched everywhere; PUBLISH(b)
    follows at the end of step b + 1, so the sharded optimizer's broadcasts of the new weights have the rest of batch
    b + 1 to hide behind (at 13B, 8 x 8, m = 128: 56 microbatches, where they take about 3). None where batch b + 1
    has no such forward (then CLIP and STEP(b) run at the end of step b + 1, right before PUBLISH(b))."""
    after = prepare_after(num_stages, num_microbatches, lookahead) + num_stages - 1
    return after if after < num_microbatches else None


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


def evaluation(stage: int, num_stages: int, num_microbatches: int) -> list[Action]:
    """An evaluation's (or prediction's) actions on ``stage``: each microbatch received from the stage before (past
    the first), run forward-only on the newest weights, sent on (before the last); then the sends waited for. No
    weight version: evaluation follows a drain. The executor (``StageExecutor.evaluate``) and the NCCL lowering
    (``verify/comm_plan.py``) both run this list."""
    actions: list[Action] = []
    for microbatch in range(num_microbatches):
        if stage > 0:
            actions.append(Action(RECV_FORWARD, 0, microbatch))
        actions.append(Action(EVAL, 0, microbatch))
        if stage < num_stages - 1:
            actions.append(Action(SEND_FORWARD, 0, microbatch))
    return actions + [Action(WAIT_SENDS, 0)]


def stream(layout: Layout, stage: int, num_batches: int) -> list[Action]:
    """All actions of ``num_batches`` steps followed by the drain: one run between two drains."""
    actions: list[Action] = []
    for batch in range(num_batches):
        actions += segment(layout, stage, batch)
    return actions + drain(layout, stage, num_batches - 1)


def _of(layout: Layout) -> tuple[Mode, int, int, int]:
    """The layout's schedule facts (a ``Layout`` is valid by construction: nothing is checked per step)."""
    return layout.mode, layout.num_stages, layout.num_microbatches, layout.lookahead  # type: ignore[return-value]
