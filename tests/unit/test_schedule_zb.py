"""ZB-H1 as data: its order against torch's zero-bubble schedule, every W after its B and before the update, and
the lowering's last backward moved to the last W (where the gradients are complete)."""

from __future__ import annotations

import pytest
from torch.distributed.pipelining import schedules as torch_schedules

from lightning_pd2bw.engine.layout import Layout
from lightning_pd2bw.engine.schedules import schedule as S
from lightning_pd2bw.engine.schedules.lowering import lower

SHAPES = [(1, 1), (2, 2), (2, 4), (3, 5), (4, 4), (4, 8), (4, 9)]
_TORCH_KIND = {"FORWARD": S.FORWARD, "BACKWARD_INPUT": S.BACKWARD, "BACKWARD_WEIGHT": S.WEIGHT}


def torch_zb_h1(stage: int, num_stages: int, num_microbatches: int) -> list[tuple[str, int]]:
    """torch's ZB-H1 order for one rank holding one stage: what ``ScheduleInterleavedZeroBubble`` computes per rank
    (``_calculate_single_rank_operations`` with one local stage: warm-up ``d - 1 - s``, ``s`` backwards before the
    first W), with its idle slots dropped."""
    warmup = min(num_stages - 1 - stage, num_microbatches)
    ops = torch_schedules._get_1f1b_rank_ops(
        1,
        num_stages,
        warmup,
        num_microbatches - warmup,
        warmup,
        stage,
        lambda step: stage,
        lambda step: stage,
        num_1f1b_microbatches=stage,
        enable_zero_bubble=True,
    )
    return [(_TORCH_KIND[op.computation_type.name], op.microbatch_index) for op in ops if op is not None]


@pytest.mark.parametrize("num_stages,num_microbatches", SHAPES)
def test_the_order_is_torchs_zero_bubble_h1(num_stages, num_microbatches):
    layout = Layout(num_stages, num_microbatches, "zb_h1")
    for stage in range(num_stages):
        ours = [
            (a.kind, a.microbatch % num_microbatches)
            for a in S.segment(layout, stage, 1)
            if a.kind in (S.FORWARD, S.BACKWARD, S.WEIGHT)
        ]
        assert ours == torch_zb_h1(stage, num_stages, num_microbatches), f"stage {stage}"


@pytest.mark.parametrize("num_stages,num_microbatches", SHAPES)
def test_every_w_follows_its_b_and_precedes_the_update(num_stages, num_microbatches):
    layout = Layout(num_stages, num_microbatches, "zb_h1")
    for stage in range(num_stages):
        actions = S.segment(layout, stage, 0)
        where = {(a.kind, a.microbatch): i for i, a in enumerate(actions)}
        reduce_at = next(i for i, a in enumerate(actions) if a.kind == S.REDUCE)
        for k in range(num_microbatches):
            assert where[(S.BACKWARD, k)] < where[(S.WEIGHT, k)] < reduce_at
        # stage s holds at most s + 1 W pending (its activations' share ZB-H1 keeps: 1F1B's memory)
        pending = held = 0
        for action in actions:
            pending += (action.kind == S.BACKWARD) - (action.kind == S.WEIGHT)
            held = max(held, pending)
        assert held == min(stage + 1, num_microbatches)
        # the input gradient goes upstream before the deferred W runs
        if stage > 0:
            for k in range(num_microbatches):
                assert where[(S.SEND_BACKWARD, k)] == where[(S.BACKWARD, k)] + 1


def test_a_flush_schedule_is_zb_h1_without_its_w():
    for num_stages, num_microbatches in SHAPES:
        for stage in range(num_stages):
            split = S.segment(Layout(num_stages, num_microbatches, "zb_h1"), stage, 2)
            flush = S.segment(Layout(num_stages, num_microbatches, "flush"), stage, 2)
            assert [a for a in split if a.kind != S.WEIGHT] == flush


def test_the_buckets_start_at_the_last_w_not_the_last_b():
    layout = Layout(2, 4, "zb_h1")
    ops = lower(S.segment(layout, 0, 0), (), 4)
    last = [op for op in ops if op.last]
    assert [str(op) for op in last] == ["W(m3,v0)"]
    assert [str(op) for op in ops if op.reclaims or op.kind == S.BACKWARD and op.last] == []
    flush_last = [str(op) for op in lower(S.segment(Layout(2, 4, "flush"), 0, 0), (), 4) if op.last]
    assert flush_last == ["B(m3,v0)"]


def test_the_text_form_parses_back():
    action = S.Action(S.WEIGHT, 1, 5, 1)
    assert str(action) == "W(m5,v1)" and S.Action.parse("W(m5,v1)", 4) == action


def test_compile_and_lookahead_are_refused_with_zb_h1_by_name():
    from lightning_pd2bw import PipeDream2BWStrategy
    from lightning_pd2bw.engine.options import PipelineOptions

    for value in (True, {"backend": "aot_eager"}):
        with pytest.raises(ValueError, match="zb_h1.*linear maps"):
            PipelineOptions(mode="zb_h1", compile=value)
    assert PipelineOptions(mode="zb_h1", compile=False).mode == "zb_h1"
    with pytest.raises(ValueError, match=r"lookahead=1.*zb_h1"):
        PipeDream2BWStrategy(mode="zb_h1", lookahead=1)


@pytest.mark.parametrize("mode", ["flush", "gpipe", "2bw", "zb_h1"])
def test_a_program_dumped_as_text_reads_back_as_the_same_actions(mode):
    from lightning_pd2bw.engine.schedules import program

    layout = Layout(3, 5, mode)
    written = program.programs(layout, 3)
    text = program.dump(written)
    assert text.splitlines()[0] == "stage,index,action" and "W(m0,v0)" in text or mode != "zb_h1"
    assert program.load(text, 5) == written
    broken = text.replace("\n1,2,", "\n1,3,", 1)
    with pytest.raises(ValueError, match="line .*: stage 1's action #3 follows #1"):
        program.load(broken, 5)
    with pytest.raises(ValueError, match="is not an action"):
        program.load("stage,index,action\n0,0,Q(m1)\n", 5)
