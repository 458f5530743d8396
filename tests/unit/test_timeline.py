"""Timeline recording, the bubble fraction, the Chrome trace, the Gantt chart and the activation meter."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import torch
from torch import nn

from lightning_pd2bw.engine.comm.transport import StageLink
from lightning_pd2bw.engine.executor import StageExecutor
from lightning_pd2bw.engine.layout import Layout
from lightning_pd2bw.engine.schedules import schedule as S
from lightning_pd2bw.engine.state.versions import WeightVersions
from lightning_pd2bw.observe.activations import ActivationMeter
from lightning_pd2bw.observe.gantt import draw_gantt
from lightning_pd2bw.observe.timeline import Event, Recorder, StageTimeline, bubble_fraction, busy_seconds, chrome_trace
from tests.stage_update import local_update


def event(kind: str, start: float, end: float, batch: int = 0, microbatch: int = -1) -> Event:
    return Event(kind, batch, microbatch, 0, start, end)


def test_bubble_of_a_synthetic_timeline_by_hand():
    # F 1 s, B 2 s, waiting on a receive 1 s, an update of 1 s: its all-reduce 0.4 s, its clip 0.1 s (both
    # bubble), its optimizer step 0.5 s, then 1 s idle
    events = [
        event(S.FORWARD, 0.0, 1.0, microbatch=0),
        event(S.BACKWARD, 1.0, 3.0, microbatch=0),
        event(S.RECV_FORWARD, 3.0, 4.0, microbatch=1),
        event(S.REDUCE, 4.0, 4.4),
        event(S.CLIP, 4.4, 4.5),
        event(S.STEP, 4.5, 5.0),
    ]
    assert busy_seconds(events) == pytest.approx(3.5)
    assert bubble_fraction(events, 0.0, 6.0) == pytest.approx(1 - 3.5 / 6)
    # a window cuts the events that straddle it: [0.5, 2] holds 0.5 s of F and 1 s of B
    assert bubble_fraction(events, 0.5, 2.0) == pytest.approx(0.0)
    assert bubble_fraction(events, 2.0, 4.0) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="empty window"):
        bubble_fraction(events, 1.0, 1.0)


def single_stage_executor(
    mode: str, m: int, make_step: Callable[[nn.Module], Callable[[int], None]] = lambda model: lambda batch: None
) -> tuple[StageExecutor, nn.Module]:
    """One stage alone; at each STEP ``make_step(model)(batch)`` runs (see ``tests/stage_update.py``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    versions = WeightVersions(model.parameters(), double_buffer=mode == "2bw")
    executor = StageExecutor(
        list(model),
        0,
        Layout(1, m, mode),
        StageLink(None, None, torch.device("cpu")),
        versions,
        input_fn=lambda mb: mb["x"],
        loss_fn=lambda out, mb: nn.functional.mse_loss(out, mb["y"]),
        handlers=local_update(versions, make_step(model)),
    )
    return executor, model


@pytest.mark.parametrize("mode", ["2bw", "flush"])
def test_executor_records_every_action_once_in_order(mode):
    m, steps = 2, 3

    def make_step(model: nn.Module) -> Callable[[int], None]:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return lambda batch: (optimizer.step(), optimizer.zero_grad())

    executor, model = single_stage_executor(mode, m, make_step)
    executor.recorder = Recorder()
    expected: list[S.Action] = []
    for step in range(steps):
        batch = step if mode == "2bw" else 0  # flush drains every step: the version rule restarts
        executor.feed(batch, [{"x": torch.randn(2, 4), "y": torch.randn(2, 1)} for _ in range(m)])
        actions = S.segment(Layout(1, m, mode), 0, batch)
        expected += actions
        executor.run(actions)
        if mode != "2bw":
            executor.finish_drain()
    events = executor.recorder.take()  # the timeline's vocabulary is the schedule's: every action, once
    assert [(e.kind, e.batch, e.microbatch, e.version) for e in events] == [
        (a.kind, a.batch, a.microbatch, a.weight_version) for a in expected
    ]
    assert all(e.end >= e.start for e in events)
    assert all(b.start >= a.end for a, b in zip(events, events[1:]))  # sequential, never overlapping
    assert executor.recorder.take() == []  # take() hands over and starts afresh


def test_chrome_trace_has_one_process_per_stage_and_complete_events(tmp_path):
    timelines = [
        StageTimeline(0, 0, 0, [event(S.FORWARD, 0.0, 0.002, microbatch=0), event(S.STEP, 0.003, 0.004)]),
        StageTimeline(1, 1, 0, [event(S.FORWARD, 0.002, 0.004, microbatch=0)]),
    ]
    trace = chrome_trace(timelines)
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "stage 0", 1: "stage 1"}
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["name"], e["ts"], e["dur"]) for e in spans] == [
        (0, "F b0 m0", 0.0, pytest.approx(2000.0)),
        (0, "STEP b0", pytest.approx(3000.0), pytest.approx(1000.0)),
        (1, "F b0 m0", pytest.approx(2000.0), pytest.approx(2000.0)),
    ]
    json.dumps(trace)  # serialisable as is
    assert StageTimeline.from_dict(json.loads(json.dumps(timelines[0].to_dict()))) == timelines[0]
    path = draw_gantt(timelines, tmp_path / "t.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_activation_meter_counts_saved_storages_once_and_excludes_weights():
    layer = nn.Linear(64, 64)
    meter = ActivationMeter(layer.parameters())
    x = torch.randn(32, 64, requires_grad=True)
    with meter.hooks():
        h = layer(x)  # saves x (the weight is excluded)
        y = h.exp()  # saves its result
        z = (y[:, :32] * y[:, 32:]).sum()  # saves two views of y's storage: counted once
    assert meter.current == x.numel() * 4 + y.numel() * 4
    z.backward()
    del z, y, h
    assert meter.current == 0
    assert meter.peak == x.numel() * 4 + 32 * 64 * 4


def test_executor_meter_sees_the_stash_of_1f1b():
    """d=1: each microbatch's activations are freed by its backward, so the peak is one microbatch."""
    executor, model = single_stage_executor("flush", 4)
    executor.meter = ActivationMeter(model.parameters())
    executor.feed(0, [{"x": torch.randn(8, 4), "y": torch.randn(8, 1)} for _ in range(4)])
    executor.run(S.segment(Layout(1, 4, "flush"), 0, 0))
    assert executor.meter.current == 0
    one_microbatch = executor.meter.peak
    assert one_microbatch > 0
    executor.meter = ActivationMeter(model.parameters())
    executor.feed(1, [{"x": torch.randn(8, 4), "y": torch.randn(8, 1)} for _ in range(4)])
    executor.run(S.segment(Layout(1, 4, "gpipe"), 0, 1))  # all forwards first: 4 stashed
    assert executor.meter.peak == pytest.approx(4 * one_microbatch, rel=0.05)
