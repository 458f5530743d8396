"""Interleaved 1F1B as data: its order against torch's ``ScheduleInterleaved1F1B``, its messages matched in order on
every link, and its simulated step against Megatron-LM's bubble, ``(m + (d - 1) / V) (F + B)`` with equal chunks;
the mode planned, refused for a run by name."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from lightning_pd2bw.engine.layout import Layout
from lightning_pd2bw.engine.options import PipelineOptions
from lightning_pd2bw.engine.schedules import schedule as S
from lightning_pd2bw.engine.schedules.lowering import lower
from lightning_pd2bw.engine.updates.update import UpdateShape
from lightning_pd2bw.planner.simulate import StageCosts, simulate

# (d, m, V): m a multiple of d, and torch's rounds of m // (m // d) microbatches (4, 10: two rounds of 5)
SHAPES = [(2, 2, 2), (2, 4, 2), (2, 4, 3), (3, 6, 2), (4, 4, 2), (4, 8, 2), (4, 8, 3), (4, 10, 2), (4, 16, 4)]


def torch_interleaved(rank: int, d: int, m: int, chunks: int) -> list[tuple[str, int, int]]:
    """torch's interleaved 1F1B order for ``rank`` (``ScheduleInterleaved1F1B._calculate_single_rank_operations``,
    built from the same helpers), idle slots dropped: (kind, microbatch, chunk)."""
    per_round = m // max(1, m // d)
    warmup = torch_schedules._get_warmup_ops(rank, chunks, per_round, d, m, multiply_factor=2)
    fwd_bwd = chunks * m - warmup
    ops = torch_schedules._get_1f1b_rank_ops(
        chunks,
        d,
        warmup,
        fwd_bwd,
        chunks * m - fwd_bwd,
        rank,
        lambda step: ((step // per_round) % chunks) * d + rank,
        lambda step: (chunks - 1 - ((step - warmup) // per_round) % chunks) * d + rank,
    )
    kinds = {"FORWARD": S.FORWARD, "FULL_BACKWARD": S.BACKWARD}
    return [(kinds[op.computation_type.name], op.microbatch_index, op.stage_index // d) for op in ops if op is not None]


@pytest.mark.parametrize("d,m,chunks", SHAPES)
def test_the_order_is_torchs_interleaved_1f1b(d, m, chunks):
    layout = Layout(d, m, "interleaved", virtual_stages=chunks)
    for rank in range(d):
        ours = [
            (a.kind, a.microbatch, a.chunk) for a in S.segment(layout, rank, 0) if a.kind in (S.FORWARD, S.BACKWARD)
        ]
        assert ours == torch_interleaved(rank, d, m, chunks), f"rank {rank}"


@pytest.mark.parametrize("d,m,chunks", SHAPES)
def test_every_message_is_received_in_the_order_it_is_sent(d, m, chunks):
    """On each link (rank to rank), the receiving rank takes the messages in the sender's order: what NCCL's
    matching in issue order needs; the first virtual stage receives nothing, the last sends nothing on."""
    layout = Layout(d, m, "interleaved", virtual_stages=chunks)
    sent: dict[tuple[int, int], list] = {}
    taken: dict[tuple[int, int], list] = {}
    for rank in range(d):
        for a in S.segment(layout, rank, 1):
            here = a.chunk * d + rank
            if a.kind in (S.SEND_FORWARD, S.SEND_BACKWARD):
                to = here + 1 if a.kind == S.SEND_FORWARD else here - 1
                assert 0 <= to < d * chunks
                sent.setdefault((rank, to % d), []).append((a.kind, a.microbatch, here))
            elif a.kind in (S.RECV_FORWARD, S.RECV_BACKWARD):
                source = here - 1 if a.kind == S.RECV_FORWARD else here + 1
                kind = S.SEND_FORWARD if a.kind == S.RECV_FORWARD else S.SEND_BACKWARD
                taken.setdefault((source % d, rank), []).append((kind, a.microbatch, source))
    assert sent == taken
    assert sum(len(v) for v in sent.values()) == 2 * m * (d * chunks - 1)


def test_the_buckets_start_at_the_first_chunks_last_backward():
    layout = Layout(2, 4, "interleaved")
    ops = lower(S.segment(layout, 0, 0), (), 4)
    last = [op for op in ops if op.last]
    first = [op for op in ops if op.reclaims or (op.kind == S.BACKWARD and op.microbatch == 0 and op.action.chunk == 1)]
    assert [str(op) for op in last] == ["B(m3,v0)"] and str(first[0]) == "B(m0,v0,c1)"
    assert S.Action.parse("B(m5,v0,c1)", 4) == S.Action(S.BACKWARD, 1, 5, 0, 1)


@pytest.mark.parametrize("d,m,chunks", [s for s in SHAPES if s[1] % s[0] == 0])
def test_the_simulated_step_is_megatrons_bubble(d, m, chunks):
    """Equal chunks, free messages, no update: 1F1B's step (m + d - 1)(F + B) becomes (m + (d - 1) / V)(F + B)."""
    shape = UpdateShape(double_buffered=False)
    free = lambda stage, collective: 0.0  # noqa: E731
    forward, backward = 1.0, 2.0
    flush = simulate(Layout(d, m, "flush"), [StageCosts(forward, backward, shape=shape)] * d, free).step_time
    chunk = StageCosts(forward / chunks, backward / chunks, shape=shape)
    layout = Layout(d, m, "interleaved", virtual_stages=chunks)
    interleaved = simulate(layout, [chunk] * (d * chunks), free).step_time
    assert flush == pytest.approx((m + d - 1) * (forward + backward), rel=1e-9)
    assert interleaved == pytest.approx((m + (d - 1) / chunks) * (forward + backward), rel=1e-9)


def test_the_layout_is_checked_and_what_it_does_not_run_is_refused_by_name():
    from lightning_pd2bw.engine.interleaving import check_interleaved

    with pytest.raises(ValueError, match="an int >= 2"):
        Layout(2, 4, "interleaved", virtual_stages=1)
    with pytest.raises(ValueError, match="needs mode='interleaved'"):
        Layout(2, 4, "flush", virtual_stages=2)
    with pytest.raises(ValueError, match="rounds of equal size"):
        Layout(4, 9, "interleaved")  # two rounds cannot split 9 microbatches
    with pytest.raises(ValueError, match="needs num_stages >= 2"):
        Layout(1, 1, "interleaved")
    assert Layout(2, 4, "interleaved").virtual_stages == 2 and Layout(2, 4).virtual_stages == 1
    layout = Layout(2, 4, "interleaved")
    check_interleaved(PipelineOptions(mode="interleaved"), layout)  # over gloo and NCCL alike (its ring in lockstep)
    for options, said in (
        (PipelineOptions(mode="interleaved", recompute=True), r"recompute=...\) is not supported"),
        (PipelineOptions(mode="interleaved", compile=True), r"\(compile=...\) is not supported"),
    ):
        with pytest.raises(ValueError, match=said):
            check_interleaved(options, layout)


@pytest.mark.parametrize("d,m,chunks", SHAPES)
def test_each_update_follows_its_batchs_last_backward_and_the_text_round_trips(d, m, chunks):
    layout = Layout(d, m, "interleaved", virtual_stages=chunks)
    for rank in range(d):
        actions = S.stream(layout, rank, 2)
        assert [S.Action.parse(str(a), m) for a in actions] == actions
        for batch in range(2):
            mine = [a for a in actions if a.batch == batch]
            backwards = [i for i, a in enumerate(mine) if a.kind == S.BACKWARD]
            update = [a.kind for a in mine if a.kind in S.UPDATE_KINDS]
            assert update == [*S.UPDATE_PARTS, S.STEP, S.PUBLISH]
            assert max(backwards) < next(i for i, a in enumerate(mine) if a.kind == S.REDUCE)
            # every chunk runs each microbatch forward, then backward
            for chunk in range(chunks):
                for k in range(batch * m, (batch + 1) * m):
                    f = next(i for i, a in enumerate(mine) if (a.kind, a.microbatch, a.chunk) == (S.FORWARD, k, chunk))
                    b = next(i for i, a in enumerate(mine) if (a.kind, a.microbatch, a.chunk) == (S.BACKWARD, k, chunk))
                    assert f < b
