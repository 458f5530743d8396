"""A rank's whole program as data (``engine/schedules/program.py``): how each step ends, 2BW's synchronous start,
the stop agreement, drains, the text form; and the two interpreters beside the engine reading the same lists (the
NCCL model proves the synchronous start, the simulator times it)."""

from __future__ import annotations

import itertools

import pytest

from lightning_pd2bw.engine.layout import Layout
from lightning_pd2bw.engine.schedules import program
from lightning_pd2bw.engine.schedules import schedule as S
from lightning_pd2bw.engine.schedules.lowering import lower
from lightning_pd2bw.engine.updates.update import UpdateShape
from lightning_pd2bw.engine.verify.comm_plan import CommLayout, programs
from lightning_pd2bw.engine.verify.nccl_model import simulate as replay
from lightning_pd2bw.planner.simulate import StageCosts, simulate

SHAPES = [(2, 2), (2, 4), (3, 3), (4, 8)]  # (stages, microbatches)


def kinds(actions: list[S.Action]) -> list[S.Kind]:
    return [action.kind for action in actions]


def test_a_step_ends_as_its_mode_says():
    layout = Layout(2, 2, "flush")
    flushed = program.train_step(layout, 1, 0, flag=True)
    assert flushed[0] == S.Action(S.FLAG, 0)
    assert flushed[1:-3] == S.segment(layout, 1, 0)
    assert flushed[-3:] == [S.Action(S.DRAINED, 0), S.Action(S.TAKE_LOSS, 0), S.Action(S.RESTART, 0)]
    twobw = Layout(2, 2, "2bw")
    assert program.train_step(twobw, 0, 0) == S.segment(twobw, 0, 0)  # no flag, no loss known yet
    assert program.train_step(twobw, 0, 3)[-1] == S.Action(S.TAKE_LOSS, 2)  # the previous batch's (overlapped)


def test_a_synchronous_start_step_is_its_segment_and_its_drain_and_returns_its_own_loss():
    layout = Layout(3, 3, "2bw")
    for stage in range(3):
        step = program.train_step(layout, stage, 0, synchronous=True, flag=True)
        assert step == [S.Action(S.FLAG, 0), *S.segment(layout, stage, 0), *program.drain(layout, stage, 0)]
        assert step[-3:] == [S.Action(S.SETTLE, 0), S.Action(S.TAKE_LOSS, 0), S.Action(S.RESTART, 0)]


@pytest.mark.parametrize("mode", ["2bw", "flush", "zb_h1", "gpipe"])
@pytest.mark.parametrize("stages,microbatches", SHAPES)
def test_every_loss_is_broadcast_once_and_taken_once_after_it_and_every_step_flagged(mode, stages, microbatches):
    layout = Layout(stages, microbatches, mode)
    scenario = program.Scenario(steps=6, sync_steps=2, drain_after=(4,), flag=True)
    for stage in range(stages):
        actions = program.rank_program(layout, stage, scenario)
        broadcast, taken, numbered = set(), [], 0
        for action in actions:
            if action.kind == S.LOSS:
                assert action.batch not in broadcast, f"{action} twice in the run"
                broadcast.add(action.batch)
            elif action.kind == S.TAKE_LOSS:
                assert action.batch in broadcast, f"{action} before its LOSS"
                taken.append(action.batch)
                broadcast.discard(action.batch)
            elif action.kind == S.RESTART:
                assert not broadcast, f"losses {broadcast} still untaken at {action}"
                numbered += 1
        assert not broadcast
        assert len(taken) == 6  # one loss a step, each returned once (2BW's last by the run's drain)
        assert kinds(actions).count(S.FLAG) == 6 and kinds(actions)[-1] == S.LAST_FLAG


def test_sends_are_batched_only_with_receives_of_their_own_segment():
    """A step of the synchronous start runs its segment and its drain in one list: the send ending the segment must
    not take a receive of the drain into its batch (its peer posts that receive in a later call)."""
    layout = Layout(2, 4, "2bw")
    for stage in range(2):
        actions = program.train_step(layout, stage, 0, synchronous=True)
        cut = actions.index(S.Action(S.LOSS, 0)) + 1
        apart = {**S.fuse_receives(actions[:cut]), **{cut + i: a for i, a in S.fuse_receives(actions[cut:]).items()}}
        lowered = {op.index: op.fused for op in lower(actions, (), 4) if op.fused is not None}
        assert lowered == apart


@pytest.mark.parametrize("mode", ["2bw", "flush", "zb_h1"])
def test_a_whole_program_dumped_as_text_reads_back_as_the_same_actions(mode):
    layout = Layout(3, 5, mode)
    written = program.programs(layout, program.Scenario(steps=4, sync_steps=1, drain_after=(3,), flag=True))
    assert program.load(program.dump(written), 5) == written


@pytest.mark.parametrize("stages,microbatches,width", [(2, 2, 1), (2, 4, 2), (3, 3, 1), (4, 8, 1)])
def test_the_nccl_model_proves_the_synchronous_start(stages, microbatches, width):
    """The start's steps lowered as the engine runs them (each drained at once), then 2BW, with clipping, tied
    weights and sharded gradients: deadlock-free with kernels one at a time."""
    for sync_steps, clip in itertools.product((1, 3), ("global", None)):
        layout = CommLayout(
            "2bw", stages, microbatches, width, steps=5, clip=clip, tied=True, sync_steps=sync_steps,
            shard_gradients=width > 1, drain_after=(4,), eval_batches=1,
        )  # fmt: skip
        lowered = programs(layout)
        assert replay(lowered, serialized=True).steps > 0
        flags = [op for op in lowered[0] if op.label.startswith("all_reduce: sigterm flag")]
        assert len(flags) == 5


def test_the_simulator_times_the_synchronous_start_as_flush():
    """2BW's start step is 1F1B drained, its update at the end: with the same costs it lasts as long as Flush's step
    (an independent schedule), and longer than 2BW's own steady step."""
    cost_of = lambda stage, collective: 0.05  # noqa: E731

    def costs(stages: int, double: bool) -> list[StageCosts]:
        shape = UpdateShape(double_buffered=double)
        return [StageCosts(forward=1.0, backward=2.0, send=0.1, step=0.5, read_gradients=0.2, shape=shape)] * stages

    for stages, microbatches in SHAPES:
        flush = simulate(Layout(stages, microbatches, "flush"), costs(stages, False), cost_of)
        start = simulate(Layout(stages, microbatches, "2bw"), costs(stages, True), cost_of, synchronous=True)
        twobw = simulate(Layout(stages, microbatches, "2bw"), costs(stages, True), cost_of)
        assert start.step_time == pytest.approx(flush.step_time, rel=1e-12)
        assert twobw.step_time < start.step_time


def test_a_stages_setup_makes_its_replicas_and_tied_copies_equal_in_order():
    """``build.py`` runs this list and the NCCL model lowers it: replica 0's weights first, then each tied parameter."""
    assert program.setup(1, 0) == []
    assert program.setup(2, 2) == [
        S.Action(S.SETUP_REPLICAS, 0),
        S.Action(S.SETUP_TIED, 0),
        S.Action(S.SETUP_TIED, 1),
    ]
    ops = programs(CommLayout("2bw", 2, 2, 2, steps=1, tied=True))[0]
    setup = [op.label for op in ops if "at setup" in op.label and op.kind != "wait"]
    assert [label.split(": ")[0] for label in setup] == ["broadcast", "all_reduce", "broadcast"]


def test_the_width_rule_is_read_from_the_run_and_the_candidate():
    """What a width shards (the optimizer; the gradients to their owners) is one rule, ``layout.shards``:
    nothing at width 1, whatever the options say; the gradients follow the optimizer unless set."""
    from lightning_pd2bw.engine.options import PipelineOptions
    from lightning_pd2bw.planner import Candidate

    assert PipelineOptions(num_stages=2).resolve(2).shards == (False, False)
    assert PipelineOptions(num_stages=2).resolve(4).shards == (True, True)
    assert PipelineOptions(num_stages=2, shard_gradients=False).resolve(4).shards == (True, False)
    assert PipelineOptions(num_stages=2, shard_optimizer=False).resolve(4).shards == (False, False)
    run = PipelineOptions(num_stages=2).resolve(6)
    assert Candidate.of(run.options, run.width, run.num_stages, 1).shards == run.shards
