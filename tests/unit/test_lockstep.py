"""The ring's lockstep (``schedules/lockstep.py``): interleaved 1F1B's messages, one batch per tick, proven free of
deadlock under NCCL's semantics (``nccl_model``, kernels concurrent and one at a time) at d = 2-4, V = 2-3, width 1-2,
with clipping, tied weights, drains and evaluation; every message received in the tick it is sent; each rank's
compute in torch's interleaved order; and the same messages sent alone (no batch) deadlock, so the check can fail."""

from __future__ import annotations

import itertools

import pytest

from lightning_pd2bw.engine.layout import Layout
from lightning_pd2bw.engine.schedules import schedule as S
from lightning_pd2bw.engine.schedules.lockstep import lockstep
from lightning_pd2bw.engine.verify.comm_plan import CommLayout, programs
from lightning_pd2bw.engine.verify.nccl_model import Deadlock, simulate

from .test_schedule_interleaved import SHAPES, torch_interleaved

MESSAGES = (S.SEND_FORWARD, S.RECV_FORWARD, S.SEND_BACKWARD, S.RECV_BACKWARD)


def ticks(actions: list[S.Action]) -> list[list[S.Action]]:
    """A rank's messages grouped by the TICK that closes them."""
    groups, current = [], []
    for action in actions:
        if action.kind in MESSAGES:
            current.append(action)
        elif action.kind == S.TICK:
            groups.append(current)
            current = []
    assert not current, "every message is closed by a TICK"
    return groups


def message(action: S.Action, rank: int, d: int) -> tuple[int, tuple]:
    """The peer of a message on ``rank``, and the message as both ends name it: (direction, microbatch, sender's
    virtual stage)."""
    virtual = action.chunk * d + rank
    if action.kind == S.SEND_FORWARD:
        return (rank + 1) % d, ("F", action.microbatch, virtual)
    if action.kind == S.RECV_FORWARD:
        return (rank - 1) % d, ("F", action.microbatch, virtual - 1)
    if action.kind == S.SEND_BACKWARD:
        return (rank - 1) % d, ("B", action.microbatch, virtual)
    return (rank + 1) % d, ("B", action.microbatch, virtual + 1)


@pytest.mark.parametrize("d,m,chunks", SHAPES)
def test_each_batch_meets_its_peers_batch_of_the_same_tick_and_the_order_is_torchs(d, m, chunks):
    """Between any two ranks, the k-th batch that holds messages between them holds the same messages on both ends
    (a send and its receive in the same tick), and each rank computes in torch's interleaved order."""
    layout = Layout(d, m, "interleaved", virtual_stages=chunks)
    lists = {rank: S.segment(layout, rank, 0) for rank in range(d)}
    for rank, actions in lists.items():
        computes = [(a.kind, a.microbatch, a.chunk) for a in actions if a.kind in (S.FORWARD, S.BACKWARD)]
        assert computes == torch_interleaved(rank, d, m, chunks), f"rank {rank}"
    batches = {
        rank: [[message(a, rank, d) for a in group] for group in ticks(actions)] for rank, actions in lists.items()
    }
    for a, b in itertools.permutations(range(d), 2):
        mine = [sorted(m for peer, m in batch if peer == b) for batch in batches[a]]
        theirs = [sorted(m for peer, m in batch if peer == a) for batch in batches[b]]
        assert [x for x in mine if x] == [x for x in theirs if x], (a, b)
    sent = sum(a.kind in (S.SEND_FORWARD, S.SEND_BACKWARD) for actions in lists.values() for a in actions)
    assert sent == 2 * m * (d * chunks - 1)  # every boundary, both ways, each microbatch once


def test_the_clock_refuses_orders_that_wait_on_one_another():
    forward = ((), S.Action(S.FORWARD, 0, 0, 0, chunk=1), ())  # needs virtual stage 1's forward first: never
    backward = ((), S.Action(S.BACKWARD, 0, 0, 0, chunk=0), ())  # needs virtual stage 2's backward: never
    with pytest.raises(ValueError, match="wait on one another"):
        lockstep([[(forward,)], [(backward,)]], 2, 0)


INTERLEAVED = [
    CommLayout(
        mode="interleaved",
        num_stages=d,
        num_microbatches=d * rounds,
        data_parallel_size=width,
        steps=3,
        clip=clip,
        tied=True,
        drain_after=(2,),
        eval_batches=1,
        virtual_stages=chunks,
    )
    for d, chunks, rounds, width, clip in itertools.product((2, 3, 4), (2, 3), (1, 2), (1, 2), (None, "global"))
]


@pytest.mark.parametrize(
    "layout",
    INTERLEAVED,
    ids=lambda c: f"d{c.num_stages}v{c.virtual_stages}m{c.num_microbatches}w{c.data_parallel_size}{c.clip or ''}",
)
def test_interleaved_is_deadlock_free_under_nccl(layout):
    lowered = programs(layout)
    outcome = simulate(lowered)
    assert outcome.steps > 0 and simulate(lowered, serialized=True).steps == outcome.steps
    ring = {op.channel for ops in lowered.values() for op in ops if op.kind in ("send", "recv")}
    assert ring == {f"pd2bw/ring/replica{r}" for r in range(layout.data_parallel_size)}


def test_the_ticks_messages_sent_alone_deadlock():
    """The batch is what makes the tick safe: each message its own kernel, in the same order, waits in a cycle."""
    lowered = programs(INTERLEAVED[0])
    alone = {rank: [op._replace(batch=-1) for op in ops] for rank, ops in lowered.items()}
    with pytest.raises(Deadlock, match="deadlock under NCCL semantics"):
        simulate(alone)
