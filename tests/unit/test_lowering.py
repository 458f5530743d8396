"""The one lowering (``engine/schedules/lowering.py``) the executor runs, the NCCL model checks and the simulator times:
checked against references computed apart from it (backwards counted per batch, the fused receives by a forward
scan, the parts' handlers), and the executor's update refusing an op lowered for other parts."""

from __future__ import annotations

import pytest

from lightning_pd2bw.engine.layout import Layout
from lightning_pd2bw.engine.schedules import schedule as S
from lightning_pd2bw.engine.schedules.lowering import ISSUE, RUN, WAIT, lower
from lightning_pd2bw.engine.updates.update import UpdateShape
from lightning_pd2bw.engine.updates.update_build import choose_parts, collectives

LAYOUTS = [(d, m, mode, lookahead) for d, m in ((1, 1), (2, 2), (2, 5), (4, 8)) for mode in ("flush", "gpipe", "2bw")
           for lookahead in (0, 1) if not (mode == "gpipe" and lookahead)]  # fmt: skip
SHAPE = UpdateShape(True, 2, buckets=3, tied=True, sharded=True, owners_broadcast=True, nonfinite="skip", clip="global")


def counted_last_backwards(actions: list[S.Action], m: int) -> set[int]:
    """Indices of each batch's m-th backward, counted as the executor once counted them (the reference)."""
    done: dict[int, int] = {}
    last = set()
    for index, action in enumerate(actions):
        if action.kind == S.BACKWARD:
            done[action.batch] = done.get(action.batch, 0) + 1
            if done[action.batch] == m:
                last.add(index)
    return last


@pytest.mark.parametrize("d, m, mode, lookahead", LAYOUTS)
def test_each_batchs_last_backward_is_marked_once_on_every_stage(d, m, mode, lookahead):
    layout = Layout(d, m, mode, lookahead=lookahead)
    for stage in range(d):
        actions = S.stream(layout, stage, 4)
        ops = lower(actions, collectives(SHAPE), m)
        assert [op.action for op in ops] == actions and [op.index for op in ops] == list(range(len(actions)))
        assert {op.index for op in ops if op.last} == counted_last_backwards(actions, m)
        for op in ops:
            if op.last:  # the buckets' reduces start in it: ISSUE steps only, the reducer's
                assert op.issued() and {step for step, _, _ in op.steps} == {ISSUE}


def test_a_send_carries_the_receive_batched_with_it():
    """Forward scan reference: a send's fused receive is the next exchange with the same neighbour, if a receive."""
    layout = Layout(4, 8, "2bw", lookahead=1)
    neighbour = {S.SEND_FORWARD: (S.SEND_FORWARD, S.RECV_BACKWARD), S.SEND_BACKWARD: (S.SEND_BACKWARD, S.RECV_FORWARD)}
    for stage in range(4):
        actions = S.stream(layout, stage, 3)
        for op in lower(actions, (), 8):
            if op.kind not in neighbour:
                assert op.fused is None
                continue
            following = next((a for a in actions[op.index + 1 :] if a.kind in neighbour[op.kind]), None)
            expected = following if following is not None and following.kind in S.RECEIVES else None
            assert op.fused == expected


def test_an_update_op_runs_the_parts_acting_there_each_waiting_before_it_runs_and_issuing_after():
    parts = collectives(SHAPE)
    chosen = choose_parts(SHAPE)
    actions = S.update(0)
    for op in lower(actions, parts, 2):
        assert op.ran() == [part for part in chosen if op.kind in part.ACTIONS]
        for part in chosen:
            steps = [step for step, owner, _ in op.steps if owner is part]
            assert steps == sorted(steps, key=[WAIT, RUN, ISSUE].index)  # wait, run, issue: never out of order
    declared = [(c, p) for p, cs in parts for c in cs]
    waited_somewhere = {c for c, _ in declared if c.waited is not None}
    waits = [c for op in lower(actions, parts, 2) for step, _, c in op.steps if step == WAIT]
    assert set(waits) == waited_somewhere and len(waits) == len(waited_somewhere)  # each launched one waited once


def test_the_executors_update_refuses_an_op_lowered_for_other_parts():
    """The rule runs exactly the parts the op names; an op lowered without the update's parts is refused, never run
    halfway (an executor built without ``parts`` would otherwise skip every part)."""
    import torch

    from lightning_pd2bw.engine.state.versions import WeightVersions
    from lightning_pd2bw.engine.updates.gradient_store import GradientStore
    from lightning_pd2bw.engine.updates.update import UpdateRule
    from lightning_pd2bw.engine.updates.update_parts import StopOnNonFinite

    param = torch.nn.Parameter(torch.zeros(2))
    versions = WeightVersions([param], double_buffer=False)
    rule = UpdateRule([param], versions, GradientStore([param], set(), None, False), [StopOnNonFinite.__new__(
        StopOnNonFinite)], double_buffered=False)  # fmt: skip
    (op,) = lower([S.Action(S.CHECK, 0)], (), 1)
    with pytest.raises(RuntimeError, match=r"CHECK\(b0\) lowered for parts \[\], this stage has \[.*StopOnNonFinite"):
        rule.handlers()[S.CHECK](op)
