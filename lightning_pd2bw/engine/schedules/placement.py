"""Where a batch's update goes in the action lists (``schedule.py`` calls it): the parts back to back (Flush,
GPipe, 2BW's drain) or, under 2BW, spread beside the next batch (``prepare_after``, ``finish_after``: the why is
``schedule.py``'s docstring and each function's)."""

from __future__ import annotations

from .actions import (
    BACKWARD,
    FINISH_PARTS,
    FORWARD,
    PREPARE_PARTS,
    PUBLISH,
    RECV_FORWARD,
    REDUCE,
    SEND_FORWARD,
    Action,
)


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
