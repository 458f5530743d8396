"""The planner's simulator (``planner/simulate.py``) against hand-computed timelines of the engine's schedules."""

from __future__ import annotations

from collections import Counter

import pytest

from lightning_pd2bw.engine.layout import Layout
from lightning_pd2bw.engine.updates.collectives import Collective
from lightning_pd2bw.engine.updates.update import UpdateShape
from lightning_pd2bw.planner.simulate import SIMULATED_MICROBATCHES, StageCosts, lower, simulate


def free(stage: int, collective: Collective) -> float:
    return 0.0


@pytest.mark.parametrize("mode", ["2bw", "flush", "gpipe"])
@pytest.mark.parametrize(("d", "m"), [(2, 2), (2, 8), (4, 4), (4, 8), (8, 16)])
def test_equal_stages_take_the_textbook_time(mode, d, m):
    """Equal stages, free messages: 2BW never drains, m (F + B) per step; flush and GPipe fill and drain the
    pipeline every batch, (m + d - 1)(F + B)."""
    costs = [StageCosts(2.0, 4.0, shape=UpdateShape(mode == "2bw"))] * d
    timing = simulate(Layout(d, m, mode), costs, free)
    assert timing.step_time == pytest.approx(m * 6.0 if mode == "2bw" else (m + d - 1) * 6.0)
    assert timing.busy == pytest.approx([m * 6.0] * d)


def test_a_slow_link_is_paid_per_microbatch_where_the_receive_is_posted_late():
    """A message longer than a stage's compute. Under NCCL's semantics a message moves only once its receive is
    posted, and the last stage posts RECV_F(k + 1) in one batch with SEND_B(k) (``schedule.fuse_receives``): in the
    steady state each microbatch costs it the message, then its forward and backward, 10 + 1 + 2 = 13, whatever the
    lookahead (the receive is posted no earlier)."""
    for lookahead in (0, 2):
        costs = [StageCosts(1.0, 2.0, send=10.0, shape=UpdateShape(True))] * 2
        timing = simulate(Layout(2, 16, "2bw", lookahead=lookahead), costs, free)
        assert timing.step_time == pytest.approx(16 * 13.0)


def bucket_all_reduce(seconds: float):
    def cost(stage: int, collective: Collective) -> float:
        return seconds if collective.group == "replica" else 0.0

    return cost


def test_flush_waits_for_the_whole_all_reduce_and_2bw_hides_it_behind_the_next_batch():
    """The replica all-reduce starts at the batch's last backward. Flush's CHECK follows at once: all of it is
    exposed. 2BW's CHECK(b) runs beside batch b + 1, half a batch later: an all-reduce shorter than that cover
    costs nothing, a longer one its excess."""
    d, m, width = 1, 4, 2
    flush = [StageCosts(1.0, 2.0, shape=UpdateShape(False, width, buckets=1))]
    assert simulate(Layout(d, m, "flush"), flush, bucket_all_reduce(5.0)).exposed == pytest.approx((5.0,))
    assert simulate(Layout(d, m, "flush"), flush, bucket_all_reduce(5.0)).step_time == pytest.approx(m * 3 + 5.0)
    twobw = [StageCosts(1.0, 2.0, shape=UpdateShape(True, width, buckets=1))]
    hidden = simulate(Layout(d, m, "2bw"), twobw, bucket_all_reduce(0.5))
    assert hidden.exposed == (0.0,) and hidden.step_time == pytest.approx(m * 3)
    # CHECK(b) follows the forward of microbatch m // 2 of batch b + 1 (``schedule.prepare_after``): F B F B F,
    # 7 of cover
    long = simulate(Layout(d, m, "2bw"), twobw, bucket_all_reduce(20.0))
    assert long.exposed == pytest.approx((13.0,)) and long.step_time == pytest.approx(m * 3 + 13.0)


def test_the_global_clip_norm_waits_for_the_last_stage():
    """2BW, d = m = 4: the first stage clips batch b by a norm summed over the pipeline, which the last stage
    launches only after batch b + 1 reached it: the first stage waits (the formula's ``norm_wait``); at m = 16
    the norm is long done."""
    shape = UpdateShape(True, clip="global")
    short = simulate(Layout(4, 4, "2bw"), [StageCosts(2.0, 4.0, shape=shape)] * 4, free)
    assert short.exposed[0] > 0 and short.step_time > 4 * 6.0
    long = simulate(Layout(4, 16, "2bw"), [StageCosts(2.0, 4.0, shape=shape)] * 4, free)
    assert long.exposed == (0.0,) * 4 and long.step_time == pytest.approx(16 * 6.0)


def test_the_lowering_issues_what_the_update_declares():
    """Every stage's timed program issues each declared collective once per batch and waits for each issue."""
    shape = UpdateShape(True, 2, buckets=3, tied=True, sharded=True, owners_broadcast=True, nonfinite="skip",
                        clip="global")  # fmt: skip
    costs = [StageCosts(1.0, 2.0, shape=shape)] * 2
    programs = lower(Layout(2, 2, "2bw"), costs, free, steps=4)
    # in 4 steps of 2BW at d = 2: batches 0-2 reach REDUCE, CHECK, NORM, STEP and PUBLISH (m = 2 leaves no room
    # beside the next batch: CLIP .. PUBLISH(b) end step b + 1), and the last stage
    # runs batch 3's last backward too (stage 0 runs it in step 4). Per batch: 3 buckets x 2 owners reduced at the
    # last backward; at REDUCE the tied parameters' replica average and their sum; at CHECK the owners' flags (shard)
    # and the flag over the pipeline; at NORM the owners' norm and the norm over the pipeline; at STEP 2 owners'
    # broadcasts, waited at PUBLISH; per step the SIGTERM flag and the loss.
    for stage, program in enumerate(programs):
        issued = Counter(op[1] for op in program if op[0] == 4)  # ISSUE
        waited = Counter(op[1] for op in program if op[0] == 5)  # WAIT
        backwards = 4 if stage == 1 else 3
        replica, shard = f"pd2bw/replica/stage{stage}", f"pd2bw/shard/stage{stage}"  # grid.communicator's names
        pipeline, loss, tied = "pd2bw/pipeline/replica0", "pd2bw/loss/replica0", "pd2bw/shared/replica0/stages0-1"
        assert issued == {
            replica: 6 * backwards + 3,
            shard: 3 + 3 + 3 * 2,
            pipeline: 6,
            tied: 3,
            "world": 4,
            loss: 4,
        }
        # CHECK(b3) comes in a later step; the flag and the loss of the last step are waited at the next
        assert waited == {replica: 6 * 3 + 3, shard: 12, pipeline: 6, tied: 3, "world": 3, loss: 3}


def test_many_microbatches_extrapolate_by_the_steady_state_period():
    """Beyond the simulated count each microbatch adds the slowest stage's forward and backward (flush: + 1, the
    last stage's forward before the first backward, as in ``test_planner``'s hand timeline at m = 4: 25 = 4 x 6 + 1)."""
    d, m = 2, 4 * SIMULATED_MICROBATCHES
    costs = [StageCosts(2.0, 4.0, shape=UpdateShape(True)), StageCosts(1.0, 2.0, shape=UpdateShape(True))]
    assert simulate(Layout(d, m, "2bw"), costs, free).step_time == pytest.approx(m * 6.0)
    assert simulate(Layout(d, m, "flush"), costs, free).step_time == pytest.approx(m * 6.0 + 1.0)


def test_sharded_gradients_under_2bw_are_reclaimed_by_the_next_batchs_first_backward():
    """Issue 77: reduced to their owners, 2BW's gradients keep one bucket set, so batch b + 1's first backward waits
    for batch b's reduces (``Collective.reclaimed``), each before its share of the backward: cover of one forward
    (F B | F B ...: F = 1, B = 2), not CHECK's half a batch (7, above). One bucket, two owners, each reduce 2.5: the
    first is waited for 1.5 after the forward, the second after the backward's first half, 1.5 more: + 3 per step.
    All-reduced (two sets), the same 5 hide behind half a batch."""
    d, m, width = 1, 4, 2
    sharded = [StageCosts(1.0, 2.0, shape=UpdateShape(True, width, buckets=1, sharded=True, owners_broadcast=True))]
    whole = [StageCosts(1.0, 2.0, shape=UpdateShape(True, width, buckets=1, owners_broadcast=True))]
    short = simulate(Layout(d, m, "2bw"), sharded, bucket_all_reduce(0.25))
    assert short.step_time == pytest.approx(m * 3)
    long = simulate(Layout(d, m, "2bw"), sharded, bucket_all_reduce(2.5))
    assert long.step_time == pytest.approx(m * 3 + 3.0)
    assert simulate(Layout(d, m, "2bw"), whole, bucket_all_reduce(5.0)).step_time == pytest.approx(m * 3)


@pytest.mark.parametrize(("d", "m"), [(2, 4), (4, 4), (4, 8), (8, 16)])
def test_zb_h1_leaves_the_papers_bubble(d, m):
    """Equal F, B and W (a backward of 2, half of it deferred), free messages: 1F1B idles (d - 1)(F + B + W) per
    step; ZB-H1, whose held W fill the cooldown, (d - 1)(F + B - W) (Qi et al. 2024, section 3.1): at d = 2, m = 4,
    15 against 13."""
    split = [StageCosts(1.0, 2.0, shape=UpdateShape(False), weight_grad=1.0)] * d
    one_f_one_b = simulate(Layout(d, m, "flush"), split, free)
    zb = simulate(Layout(d, m, "zb_h1"), split, free)
    assert one_f_one_b.step_time == pytest.approx((m + d - 1) * 3.0)
    assert zb.step_time == pytest.approx(m * 3.0 + (d - 1) * 1.0)
    assert zb.busy == pytest.approx([m * 3.0] * d)


@pytest.mark.parametrize("d", [2, 4])
def test_the_update_counts_what_it_adds_to_the_step_not_the_waits_inside_the_bubble(d):
    """Issue 93, item 6. Flush with the global norm: the last stage finishes its cool-down first and waits for the
    first at the norm's all-reduce, (d - 1)(F + B) that its bubble idles anyway. What the update adds is the first
    stage's own chain, by hand: the gradients read for the non-finite flags and for the norm (0.25 each), the norm's
    sum over the pipeline (0.3), the step (0.5): 1.3, the step (m + d - 1)(F + B) + 1.3. A stage's time blocked
    inside the update (``exposed``, what the planner's table printed before) counts the bubble too."""
    from lightning_pd2bw.planner.simulate import update_added

    def norm_sum(stage: int, collective: Collective) -> float:
        return 0.3 if collective.group == "pipeline" else 0.0

    m, shape = 4, UpdateShape(False, clip="global")
    costs = [StageCosts(2.0, 4.0, step=0.5, read_gradients=0.25, shape=shape)] * d
    timing = simulate(Layout(d, m, "flush"), costs, norm_sum)
    assert timing.step_time == pytest.approx((m + d - 1) * 6.0 + 1.3)
    assert update_added(Layout(d, m, "flush"), costs, norm_sum, timing.step_time) == pytest.approx(1.3)
    assert timing.exposed[-1] == pytest.approx(0.3 + (d - 1) * 4.0)  # the last stage's wait: its bubble
