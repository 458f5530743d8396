"""``benchmarks/pipelines.py``'s report on hand-made invocations: medians of ratios taken within each invocation,
limits, the machine's ceiling, the targets, and the docs/benchmarks-log.md block it rewrites."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("pipelines_bench", ROOT / "benchmarks" / "pipelines.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def invocation(single: float, ddp: float, flush: float, twobw: float, ceiling: float) -> dict:
    stage = {"bubble": 0.05, "weight_bytes": 2**20, "activation_bytes": 2**20}
    runs = {"single": single, "ddp": ddp, "flush": flush, "2bw": twobw}
    out = {
        (k, 4): {"samples_per_sec": v, "stages": [dict(stage, stage=0), dict(stage, stage=1)]} for k, v in runs.items()
    }
    return {**out, "untraced": {"samples_per_sec": twobw}, "ceiling": ceiling}


def test_ratios_are_medians_of_each_invocations_own_ratios(bench):
    args = argparse.Namespace(procs=2, m=[4], accelerator="cpu")
    runs = [
        invocation(4.0, 7.0, 6.0, 7.6, 8.0),
        invocation(5.0, 8.0, 6.0, 8.0, 9.0),
        invocation(4.0, 8.0, 6.4, 8.4, 8.0),
    ]
    text = bench.report(args, ["single", "ddp", "flush", "2bw"], runs)
    rows = {line.split("|")[0].split()[1]: line.split("|")[1].split() for line in text.splitlines() if line[:2] == " 4"}
    # 2bw x single per invocation: 1.9, 1.6, 2.1 -> 1.9; x ddp: 1.0857, 1.0, 1.05 -> 1.05; x limit = x single / 2
    assert rows["2bw"] == ["8.00", "1.90", "1.05", "0.95"]
    # flush's limit is d x single x m/(m+d-1) = 2 x 4/5: x limit 6/(4*1.6) = 0.9375, 6/8 = 0.75, 6.4/6.4 = 1.0
    assert rows["flush"][3] == "0.94"
    assert "median 2.00" in text  # the ceiling: 8/4, 9/5, 8/4
    assert "2bw x single 1.90 (>= 1.9: met), 2bw x ddp 1.05 (>= 1.0: met)" in text


def test_the_benchmarks_page_block_is_replaced_and_a_missing_one_named(bench, tmp_path, monkeypatch):
    (tmp_path / "docs").mkdir()
    readme = tmp_path / "docs" / "benchmarks-log.md"
    readme.write_text("before\n<!-- pipelines.py d=2 cpu -->\nold\n<!-- /pipelines.py -->\nafter\n")
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    bench.write_readme("TABLE", "python benchmarks/pipelines.py --m 4", 2, "cpu")
    content = readme.read_text()
    assert content.startswith("before\n<!-- pipelines.py d=2 cpu -->\n`python benchmarks/pipelines.py --m 4`")
    assert "```\nTABLE\n```\n<!-- /pipelines.py -->\nafter\n" in content and "old" not in content
    with pytest.raises(SystemExit, match="d=8"):
        bench.write_readme("TABLE", "cmd", 8, "cpu")


def test_the_reference_is_the_mean_of_the_single_runs_that_bracket_an_invocation(bench):
    args = argparse.Namespace(procs=2, m=[4], accelerator="cpu")
    runs = [invocation(4.0, 7.0, 6.0, 7.6, 8.0), invocation(5.0, 8.0, 6.0, 8.0, 9.0)]
    runs[0]["single", 4]["samples_per_sec"], runs[1]["single", 4]["samples_per_sec"] = 3.5, 5.25
    bench.bracket(runs[0]["single", 4], 4.5)
    bench.bracket(runs[1]["single", 4], 4.75)
    text = bench.report(args, ["single", "ddp", "flush", "2bw"], runs)
    assert "first and last run of each invocation (the reference: their mean): 3.50 / 4.50, 5.25 / 4.75" in text
    rows = {line.split("|")[0].split()[1]: line.split("|")[1].split() for line in text.splitlines() if line[:2] == " 4"}
    assert rows["single"][0] == "4.50"  # the median of the means 4.0 and 5.0
    assert rows["2bw"][1] == "1.75"  # 7.6 / 4.0 = 1.9 and 8.0 / 5.0 = 1.6


def test_the_lookahead_run_gets_its_row_bubble_and_target_line(bench):
    args = argparse.Namespace(procs=2, m=[4], accelerator="cpu")
    runs = [invocation(4.0, 7.0, 6.0, 7.6, 8.0), invocation(5.0, 8.0, 6.0, 8.0, 9.0)]
    for run, speed in zip(runs, (8.0, 9.5)):
        run["2bw+la", 4] = {**run["2bw", 4], "samples_per_sec": speed}
    text = bench.report(args, ["single", "ddp", "flush", "2bw", "2bw+la"], runs)
    rows = {line.split("|")[0].split()[1]: line.split("|")[1].split() for line in text.splitlines() if line[:2] == " 4"}
    assert rows["2bw+la"][1] == "1.95"  # 8.0 / 4.0 = 2.0 and 9.5 / 5.0 = 1.9
    assert "2bw+la x single: 2.00, 1.90" in text and "bubble % (worst stage): 5.00, 5.00" in text
    assert "2bw+la x single 1.95 (>= 1.9: met)" in text and "2bw x single 1.75 (>= 1.9: missed)" in text
