"""Schedules as data: ordering, memory bound, send/receive matching and the version rules."""

from __future__ import annotations

import pytest

from lightning_pd2bw.engine.layout import Layout, check_schedule
from lightning_pd2bw.engine.schedules import schedule as S

LAYOUTS = [(1, 1), (2, 2), (2, 4), (3, 5), (4, 4), (4, 8)]
# (mode, lookahead): lookahead applies to the 1F1B schedules; interleaved 1F1B (several chunks a stage, d >= 2):
# tests/unit/test_schedule_interleaved.py
ONE_CHUNK = [mode for mode in S.MODES if mode != "interleaved"]
SCHEDULES = [(mode, 0) for mode in ONE_CHUNK] + [("2bw", 1), ("2bw", 2), ("flush", 1)]


def stream(mode: str, stage: int, num_stages: int, num_microbatches: int, batches: int, lookahead: int = 0):
    return S.stream(Layout(num_stages, num_microbatches, mode, lookahead=lookahead), stage, batches)


def segment(mode: str, stage: int, num_stages: int, num_microbatches: int, batch: int, lookahead: int = 0):
    return S.segment(Layout(num_stages, num_microbatches, mode, lookahead=lookahead), stage, batch)


def simulate(actions_per_stage):
    """Run all stages' actions with blocking receives; fail on deadlock or an unmatched message."""
    num_stages = len(actions_per_stage)
    position = [0] * num_stages
    channels = {}  # (src, dst, kind) -> list of microbatches sent, in order
    progress = True
    while progress:
        progress = False
        for stage, actions in enumerate(actions_per_stage):
            while position[stage] < len(actions):
                action = actions[position[stage]]
                if action.kind == S.SEND_FORWARD:
                    channels.setdefault((stage, stage + 1, "F"), []).append(action.microbatch)
                elif action.kind == S.SEND_BACKWARD:
                    channels.setdefault((stage, stage - 1, "B"), []).append(action.microbatch)
                elif action.kind in (S.RECV_FORWARD, S.RECV_BACKWARD):
                    key = (stage - 1, stage, "F") if action.kind == S.RECV_FORWARD else (stage + 1, stage, "B")
                    queue = channels.get(key, [])
                    if not queue:
                        break
                    assert queue.pop(0) == action.microbatch, "messages arrive in the order they are received"
                position[stage] += 1
                progress = True
    assert position == [len(a) for a in actions_per_stage], f"deadlock at {position}"
    assert all(not q for q in channels.values()), "every send is received"


@pytest.mark.parametrize("mode,lookahead", SCHEDULES)
@pytest.mark.parametrize("num_stages,num_microbatches", LAYOUTS)
def test_stream_is_deadlock_free_and_matched(mode, lookahead, num_stages, num_microbatches):
    simulate([stream(mode, s, num_stages, num_microbatches, 3, lookahead=lookahead) for s in range(num_stages)])


def expected_stash(mode: str, stage: int, num_stages: int, num_microbatches: int, lookahead: int) -> int:
    """GPipe: all m; 1F1B: d - r, with ``lookahead`` more (at most m - d) on every stage, the last included (it
    receives ahead so that its upstream can send ahead under NCCL's rendezvous)."""
    if mode == "gpipe":
        return num_microbatches
    extra = min(lookahead, num_microbatches - num_stages)
    return num_stages - stage + extra


@pytest.mark.parametrize("mode,lookahead", SCHEDULES)
@pytest.mark.parametrize("num_stages,num_microbatches", LAYOUTS)
def test_forward_precedes_backward_and_stash_bound(mode, lookahead, num_stages, num_microbatches):
    for stage in range(num_stages):
        actions = stream(mode, stage, num_stages, num_microbatches, 3, lookahead=lookahead)
        in_flight, peak, done_forward = set(), 0, set()
        for a in actions:
            if a.kind == S.FORWARD:
                in_flight.add(a.microbatch)
                done_forward.add(a.microbatch)
            elif a.kind == S.BACKWARD:
                assert a.microbatch in done_forward
                in_flight.remove(a.microbatch)
            peak = max(peak, len(in_flight))
        assert peak == expected_stash(mode, stage, num_stages, num_microbatches, lookahead)
        assert sorted(done_forward) == list(range(3 * num_microbatches))


@pytest.mark.parametrize("lookahead", [0, 1, 2])
@pytest.mark.parametrize("num_stages,num_microbatches", LAYOUTS)
def test_2bw_version_rule_and_steps(num_stages, num_microbatches, lookahead):
    """Every forward and backward runs on the version 2BW's rule gives its batch, held when it runs (at most one
    update newer): with a lookahead too, two versions suffice."""
    for stage in range(num_stages):
        actions = stream("2bw", stage, num_stages, num_microbatches, 4, lookahead=lookahead)
        updates = 0
        for a in actions:
            if a.kind in (S.FORWARD, S.BACKWARD):
                assert a.weight_version == max(a.batch - 1, 0)
                # the version a microbatch uses exists: at most one update newer than it is applied
                assert updates - 1 <= a.weight_version <= updates
            if a.kind == S.STEP:
                assert a.batch == updates, "updates are applied in batch order"
                updates += 1
        assert updates == 4


def test_2bw_never_flushes_between_batches():
    """Stage 0 runs batch t+1's forwards before batch t's last backward (no drain)."""
    actions = stream("2bw", 0, 4, 4, 3)
    kinds = [(a.kind, a.batch) for a in actions if a.kind in (S.FORWARD, S.BACKWARD)]
    first_forward_b1 = kinds.index((S.FORWARD, 1))
    last_backward_b0 = max(i for i, k in enumerate(kinds) if k == (S.BACKWARD, 0))
    assert first_forward_b1 < last_backward_b0
    flush = [(a.kind, a.batch) for a in stream("flush", 0, 4, 4, 3) if a.kind in (S.FORWARD, S.BACKWARD)]
    assert flush.index((S.FORWARD, 1)) > max(i for i, k in enumerate(flush) if k == (S.BACKWARD, 0))


def test_1f1b_warmup_counts():
    for stage in range(4):
        actions = [a.kind for a in segment("flush", stage, 4, 8, 0) if a.kind in (S.FORWARD, S.BACKWARD)]
        assert actions.index(S.BACKWARD) == 4 - stage  # d - r - 1 warm-up forwards, then one more


@pytest.mark.parametrize("mode", ["2bw", "flush"])
def test_lookahead_adds_forwards_on_every_stage(mode):
    """d = 4, m = 6, lookahead 1: every stage runs one more forward before its first backward, the last included
    (each keeps one more than the next, so every pair's batched exchange matches); lookahead 5 is capped at
    m - d = 2; at m = d there is no room: the schedule is plain 1F1B."""

    def first_backward(stage, lookahead):
        actions = segment(mode, stage, 4, 6, 0, lookahead=lookahead)
        return [a.kind for a in actions if a.kind in (S.FORWARD, S.BACKWARD)].index(S.BACKWARD)

    assert [first_backward(stage, 0) for stage in range(4)] == [4, 3, 2, 1]
    assert [first_backward(stage, 1) for stage in range(4)] == [5, 4, 3, 2]
    assert [first_backward(stage, 5) for stage in range(4)] == [6, 5, 4, 3]
    assert stream(mode, 0, 4, 4, 3, lookahead=1) == stream(mode, 0, 4, 4, 3)


@pytest.mark.parametrize("mode", ["2bw", "flush"])
@pytest.mark.parametrize("lookahead", [1, 2, 3])
@pytest.mark.parametrize("num_stages,num_microbatches", LAYOUTS + [(4, 5), (4, 6), (3, 4)])
def test_lookahead_never_lengthens_the_unit_time_schedule(mode, lookahead, num_stages, num_microbatches):
    """With every action one slot long and messages instantaneous (``draw.timeline``), a lookahead adds no idle
    slot: 6 batches take no longer than under plain 1F1B. (A cap on stage 0 alone put stages 0 and 1 in lockstep:
    98 slots instead of 60 at d = 4, m = 4, and 15% slower measured.)"""
    from lightning_pd2bw.observe.draw import timeline

    def slots(ahead: int) -> int:
        return max(len(row) for row in timeline(mode, num_stages, num_microbatches, 6, ahead))

    assert slots(lookahead) <= slots(0)


def test_lookahead_rejects_what_it_cannot_mean():
    with pytest.raises(ValueError, match="lookahead=-1 is invalid; valid: an int >= 0"):
        segment("2bw", 0, 2, 4, 0, lookahead=-1)
    with pytest.raises(ValueError, match="lookahead=1 has no meaning under mode='gpipe'"):
        segment("gpipe", 0, 2, 4, 0, lookahead=1)


@pytest.mark.parametrize("mode,lookahead", SCHEDULES)
@pytest.mark.parametrize("num_stages,num_microbatches", LAYOUTS)
def test_an_update_begins_after_its_last_backward_and_ends_before_it_is_read(
    mode, lookahead, num_stages, num_microbatches
):
    """2BW (issue 46): REDUCE(t) follows batch t's last backward on the stage; CHECK, HOOKS and NORM(t) follow
    batch t + 1's forward of microbatch (t + 1) m + w0 (and its send) on every stage, which the first stage sends
    only after its own REDUCE(t): no stage waits for another's tied sum. Issue 62: CLIP and STEP(t) follow the forward
    of microbatch (t + 1) m + w0' + d - 1 (``finish_after``, where batch t + 1 has it), by which the last stage has
    launched the norm, and PUBLISH(t) ends step t + 1 with its broadcasts behind batch t + 1's compute; without room
    all three end step t + 1. PUBLISH(t) precedes the first forward of batch t + 2, the first to read
    W(t + 1), and REDUCE(t + 1), which makes the next version; batch t + 1 computes in between (the overlap). Flush and
    GPipe run the parts back to back at the end of their batch."""
    batches = 5
    w0 = S.warmup_forwards(0, num_stages, num_microbatches, lookahead)
    after = S.finish_after(num_stages, num_microbatches, lookahead)
    kinds = (S.REDUCE, *S.PREPARE_PARTS, *S.FINISH_PARTS, S.PUBLISH)
    for stage in range(num_stages):
        actions = stream(mode, stage, num_stages, num_microbatches, batches, lookahead)
        for t in range(batches):
            at = {kind: actions.index(S.Action(kind, t)) for kind in kinds}
            assert list(at.values()) == sorted(at.values())
            last_backward = max(i for i, a in enumerate(actions) if a.kind == S.BACKWARD and a.batch == t)
            assert last_backward < at[S.REDUCE]
            readers = [i for i, a in enumerate(actions) if a.kind == S.FORWARD and a.weight_version == t + 1]
            assert all(at[S.PUBLISH] < i for i in readers), "an update read before it is complete"
            if t + 1 < batches:
                assert at[S.PUBLISH] < actions.index(S.Action(S.REDUCE, t + 1))
            computed = [a for a in actions[at[S.REDUCE] : at[S.STEP]] if a.kind in (S.FORWARD, S.BACKWARD)]
            if mode == "2bw" and t < batches - 1:
                assert {a.batch for a in computed} == {t + 1}, "batch t + 1 computes while t's update is in flight"
                trigger = (t + 1) * num_microbatches + w0  # the forward that every stage's CHECK(t) waits behind
                forward = actions.index(S.Action(S.FORWARD, t + 1, trigger, t))
                assert forward < at[S.CHECK] and actions[at[S.CHECK] - 1].kind in (S.FORWARD, S.SEND_FORWARD)
                assert actions[at[S.CHECK] : at[S.CHECK] + 3] == S.prepare(t)
                assert actions[at[S.CLIP] : at[S.CLIP] + 2] == S.finish(t)
                step_end = actions.index(S.Action(S.LOSS, t + 1))
                assert at[S.PUBLISH] == step_end - 1, "PUBLISH ends the step: callbacks read published weights"
                if after is None:  # no room beside batch t + 1: at the end of step t + 1, back to back
                    assert at[S.PUBLISH] == at[S.STEP] + 1
                    continue
                trigger = (t + 1) * num_microbatches + after
                forward = actions.index(S.Action(S.FORWARD, t + 1, trigger, t))
                before = (S.FORWARD, S.SEND_FORWARD, S.NORM)  # NORM: one stage, at the same forward
                assert forward < at[S.CLIP] and actions[at[S.CLIP] - 1].kind in before
                behind = [a for a in actions[at[S.STEP] : at[S.PUBLISH]] if a.kind in (S.FORWARD, S.BACKWARD)]
                assert behind and {a.batch for a in behind} <= {t + 1}, "the broadcasts hide behind batch t + 1"
            else:  # flush, gpipe, and 2BW's drain: back to back
                assert actions[at[S.REDUCE] : at[S.PUBLISH] + 1] == S.update(t)


def test_the_update_finishes_beside_the_next_batch_where_it_has_room():
    """``finish_after``: d - 1 forwards after the prepare point, inside the batch (8 x 8 at 13B, m = 128: at 71,
    57 microbatches of cover); None where the batch is too short."""
    assert S.finish_after(8, 128) == 64 + 7
    assert S.finish_after(2, 4) == 3 and S.finish_after(2, 2) is None and S.finish_after(4, 4) is None
    assert S.finish_after(1, 2) == 1  # one stage: right after its own norm


def test_invalid_parameters_name_the_fix():
    with pytest.raises(ValueError, match="num_microbatches=2 is smaller than num_stages=4"):
        segment("2bw", 0, 4, 2, 0)
    with pytest.raises(ValueError, match="valid: 2bw, flush, gpipe"):
        check_schedule("pipedream", 2, 2)


@pytest.mark.parametrize("mode", ONE_CHUNK)
@pytest.mark.parametrize("num_stages, num_microbatches", LAYOUTS)
def test_actions_round_trip_through_their_text(mode, num_stages, num_microbatches):
    for stage in range(num_stages):
        actions = stream(mode, stage, num_stages, num_microbatches, 3)
        assert all(isinstance(a.kind, S.Kind) for a in actions)
        assert [S.Action.parse(str(a), num_microbatches) for a in actions] == actions


def test_action_kinds_are_typed():
    assert S.Action("RECV_B", 1, 5, 0).kind is S.Kind.RECV_BACKWARD and str(S.Kind.RECV_BACKWARD) == "RECV_B"
    with pytest.raises(ValueError, match="'SEND' is not a valid Kind"):
        S.Action("SEND", 0, 0, 0)
    with pytest.raises(ValueError, match="'F\\(m1\\)' is not an action"):
        S.Action.parse("F(m1)", 2)


def test_a_failing_action_is_shown_marked_in_the_stage_list():
    """Microbatch 1's input has the wrong width: the error carries the stage's actions with F(m1,v0) marked."""
    import torch

    from .test_timeline import single_stage_executor

    executor, _ = single_stage_executor("flush", 2)
    executor.feed(
        0, [{"x": torch.randn(2, 4), "y": torch.randn(2, 1)}, {"x": torch.randn(2, 5), "y": torch.randn(2, 1)}]
    )
    actions = segment("flush", 0, 1, 2, 0)
    with pytest.raises(RuntimeError) as error:
        executor.run(actions)
    (note,) = error.value.__notes__
    failing = actions.index(S.Action(S.FORWARD, 0, 1, 0))
    assert note.splitlines()[0] == f"pd2bw: stage 0 of 1 failed at action #{failing} F(m1,v0) of:"
    assert note.splitlines()[1 + failing] == f">> {failing:4d} F(m1,v0)   <- failed here"
    assert len(note.splitlines()) == 1 + len(actions) and "STEP(b0)" in note


@pytest.mark.parametrize("mode,lookahead", SCHEDULES)
@pytest.mark.parametrize("num_stages,num_microbatches", LAYOUTS)
def test_each_update_is_its_parts_in_order(mode, lookahead, num_stages, num_microbatches):
    """Every batch's update is REDUCE, CHECK, HOOKS, NORM, CLIP, STEP, PUBLISH, each once; under 2BW PUBLISH(b) ends
    step b + 1 (CLIP and STEP right before it where the step has no room beside its forwards) or is in the drain,
    which completes everything;
    flush batches and drains end with WAIT_SENDS, every step with LOSS(b)."""
    batches = 4
    for stage in range(num_stages):
        actions = stream(mode, stage, num_stages, num_microbatches, batches, lookahead)
        assert [S.Action.parse(str(a), num_microbatches) for a in actions] == actions
        for b in range(batches):
            parts = [a.kind for a in actions if a.batch == b and a.kind in S.UPDATE_KINDS]
            assert parts == [S.REDUCE, *S.PREPARE_PARTS, *S.FINISH_PARTS, S.PUBLISH]
            if mode == "2bw" and b + 1 < batches:  # PUBLISH(b) ends step b + 1, right before its LOSS
                step = segment(mode, stage, num_stages, num_microbatches, b + 1, lookahead)
                assert step[-2:] == [S.Action(S.PUBLISH, b), S.Action(S.LOSS, b + 1)]
                if S.finish_after(num_stages, num_microbatches, lookahead) is None:
                    assert step[-4:-2] == S.finish(b)
        waits = [a.batch for a in actions if a.kind == S.WAIT_SENDS]
        assert waits == (list(range(batches)) if mode != "2bw" else [batches - 1])
        assert [a.batch for a in actions if a.kind == S.LOSS] == list(range(batches))
        for b in range(batches):  # each step ends with its loss broadcast; a flush step waits for its sends first
            step = segment(mode, stage, num_stages, num_microbatches, b, lookahead)
            assert step[-1] == S.Action(S.LOSS, b) and (mode == "2bw" or step[-2].kind == S.WAIT_SENDS)
        assert actions[-1].kind == (S.WAIT_SENDS if mode == "2bw" else S.LOSS)  # a 2BW drain waits last


@pytest.mark.parametrize("mode,lookahead", SCHEDULES)
@pytest.mark.parametrize("num_stages,num_microbatches", LAYOUTS)
def test_no_backward_between_a_batchs_last_backward_and_its_reduce(mode, lookahead, num_stages, num_microbatches):
    """The replica all-reduce of batch b starts inside b's last backward on the stage and REDUCE(b) waits for it
    (``grad_buckets.py``): no other backward may accumulate into those gradients in between."""
    for stage in range(num_stages):
        actions = stream(mode, stage, num_stages, num_microbatches, 4, lookahead)
        for b in range(4):
            backwards = [i for i, a in enumerate(actions) if a.kind == S.BACKWARD and a.batch == b]
            assert len(backwards) == num_microbatches
            reduce = actions.index(S.Action(S.REDUCE, b))
            assert not [a for a in actions[backwards[-1] + 1 : reduce] if a.kind == S.BACKWARD]


@pytest.mark.parametrize("mode", ["2bw", "flush", "gpipe"])
@pytest.mark.parametrize("num_stages, num_microbatches, lookahead", [(2, 2, 0), (3, 5, 1), (4, 8, 2), (4, 4, 0)])
def test_the_fused_receives_pass_is_the_per_send_rule(mode, num_stages, num_microbatches, lookahead):
    """``fuse_receives`` (the one pass the executor and the NCCL verifier read) pairs each send with exactly the
    receive ``fused_receive`` names for it, over whole runs of every stage (issue 61)."""
    if mode == "gpipe":
        lookahead = 0
    for stage in range(num_stages):
        for segment in (
            *(S.segment(Layout(num_stages, num_microbatches, mode, lookahead=lookahead), stage, b) for b in range(4)),
            S.drain(Layout(num_stages, num_microbatches, mode, lookahead=lookahead), stage, 3),
            stream(mode, stage, num_stages, num_microbatches, 4, lookahead),
        ):
            sends = [i for i, a in enumerate(segment) if a.kind in (S.SEND_FORWARD, S.SEND_BACKWARD)]
            expected = {i: S.fused_receive(segment, i) for i in sends}
            assert S.fuse_receives(segment) == {i: r for i, r in expected.items() if r is not None}
