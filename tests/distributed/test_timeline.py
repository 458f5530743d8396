"""PipelineTrace on a real 2-process pd2bw run: every action recorded once and in the schedule's order
on each stage, the bubble fraction logged per stage, the merged Chrome trace and the Gantt PNG written."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from lightning_pd2bw.engine.layout import Layout
from lightning_pd2bw.engine.schedules import program
from lightning_pd2bw.engine.schedules import schedule as S

from .launch import torchrun_script
from .run_timeline import MICROBATCHES, STEPS

MODES = ["2bw", "flush"]


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> Path:
    """One job traces both modes, one Trainer after the other: ``traced / mode`` holds each run's output."""
    out = tmp_path_factory.mktemp("timeline")
    torchrun_script(Path(__file__).with_name("run_timeline.py"), [str(out), *MODES], 2, timeout=300)
    return out


@pytest.mark.parametrize("mode", MODES)
def test_trace_matches_the_schedule(traced, mode):
    out = traced / mode

    trace = json.loads((out / "timeline" / "trace.json").read_text())
    assert (out / "timeline" / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for stage in (0, 1):
        mine = sorted((e for e in spans if e["pid"] == stage), key=lambda e: e["ts"])
        actions = mine  # the timeline records each step's program: the schedule's actions, the update's parts, the
        expected = []  # stop flag at its head and how it ends (2 processes: Lightning's stop agreement runs)
        for step in range(STEPS):
            expected += program.train_step(
                Layout(2, MICROBATCHES, mode), stage, step if mode == "2bw" else 0, flag=True
            )
        got = [(e["cat"], e["args"]["batch"], e["args"]["microbatch"], e["args"]["weight_version"]) for e in actions]
        assert got == [(a.kind, a.batch, a.microbatch, a.weight_version) for a in expected]
        for a, b in zip(actions, actions[1:]):  # one stage runs one action at a time
            assert b["ts"] >= a["ts"] + a["dur"] - 1.0
        kinds = {e["cat"] for e in mine}
        if mode == "2bw":  # each update is published at the end of the next step (issues 46, 62)
            assert sorted(e["args"]["batch"] for e in mine if e["cat"] == S.STEP) == list(range(STEPS - 1))
            assert sorted(e["args"]["batch"] for e in mine if e["cat"] == S.PUBLISH) == list(range(STEPS - 1))
            assert S.WAIT_SENDS not in kinds and S.REDUCE in kinds
        else:
            assert S.WAIT_SENDS in kinds and S.REDUCE in kinds

    rows = list(csv.DictReader((out / "logs" / "version_0" / "metrics.csv").open()))
    logged = [r for r in rows if r.get("bubble/stage0")]
    assert len(logged) == STEPS // 2
    for row in logged:
        for stage in (0, 1):
            assert 0.0 <= float(row[f"bubble/stage{stage}"]) < 1.0
