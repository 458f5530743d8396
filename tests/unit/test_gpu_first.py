"""``make gpu-first``'s script cannot rot: its CPU mode runs every step's code path at toy sizes, under its timeouts,
with hydra and omegaconf unimportable (as on a bare GPU machine), and writes the folder and summary a GPU run writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.full  # ~1 min: two Lightning runs of a toy slice, the GPU tests collected
def test_the_cpu_mode_runs_every_step_without_hydra(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_first.py", "--cpu"], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    steps = json.loads((tmp_path / "steps.json").read_text())
    names = ["environment", "gemms", "semi_sparse", "slice_micro1", "slice_micro2", "pytest_gpu"]
    assert [s["step"] for s in steps] == names
    assert all(s["status"] == "ok" for s in steps), [(s["step"], s["status"], s["tail"]) for s in steps]
    gemms = json.loads((tmp_path / "gemms.json").read_text())["records"]
    assert len(gemms) == 2 * 12 + 1 and all(r["tflops"] > 0 for r in gemms)
    runs = json.loads((tmp_path / "slice_micro1.json").read_text())
    assert [r["kind"] for r in runs] == ["flush", "zb_h1"] and all(r["step_s"] > 0 for r in runs)
    summary = (tmp_path / "summary.md").read_text()
    assert "| slice_micro2 | ok |" in summary and "planner GiB" in summary


def test_a_step_that_imports_hydra_fails_and_the_next_one_runs(tmp_path):
    """The blocker is real: a step importing hydra fails (recorded, its output's tail kept), and a step that runs too
    long is stopped at its timeout; the run goes on."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_first
    finally:
        sys.path.pop(0)
    script = tmp_path / "uses_hydra.py"
    script.write_text("import hydra\n")
    slow = tmp_path / "slow.py"
    slow.write_text("import time\ntime.sleep(30)\n")
    hydra = gpu_first.run_step(gpu_first.Step("hydra", 60, (str(script),), (str(script),)), tmp_path, cpu=True)
    assert hydra["status"].startswith("failed") and "hydra" in hydra["tail"]
    stopped = gpu_first.run_step(gpu_first.Step("slow", 2, (str(slow),), (str(slow),)), tmp_path, cpu=True)
    assert stopped["status"] == "timed out after 2 s"
