"""``pd2bw-plan`` as a user runs it on a CPU-only machine: the gpt13b recipe's plan table, both modes' best rates
and the step overhead at which they tie, and the refusal that says what would fit."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.full  # a minute of two CLI runs; the fast tier plans through the CLI in test_config.py (the run that trains)
def test_pd2bw_plan_prints_a_table_on_cpu(tmp_path):
    command = [
        sys.executable,
        "-m",
        "lightning_pd2bw.cli.plan",
        "recipe=gpt13b",
        "cluster=a100_80g_8x8",
        "global_batch_size=256",  # a quarter of the recipe's: the same layouts, fewer microbatch counts to simulate
        f"hydra.run.dir={tmp_path}",
    ]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "samples/s" in result.stdout and "best: width" in result.stdout and "pd2bw-train" in result.stdout
    # 2BW's and the fastest synchronous schedule's best rates and the step overhead at which they tie
    synchronous = re.search(
        r"^synchronous plans: Flush ([\d.]+) samples/s, ZB-H1 ([\d.]+) samples/s"
        r"(?:, interleaved 1F1B ([\d.]+) samples/s)?",
        result.stdout,
        re.M,
    )
    assert synchronous, result.stdout[-2000:]
    best = float(re.search(r"^best: .*: ([\d.]+) samples/s predicted", result.stdout, re.M)[1])
    choice = re.search(
        r"^2BW or (?:Flush|ZB-H1|interleaved 1F1B): 2BW's best plan ([\d.]+) samples/s, "
        r"(?:Flush|ZB-H1|interleaved 1F1B)'s ([\d.]+) \(([\d.]+)x\)",
        result.stdout,
        re.M,
    )
    assert choice and float(choice[1]) >= round(best, 1), result.stdout[-2000:]  # 2BW at its best plan
    if float(choice[1]) > round(best, 1):  # the recipe's shard_gradients is not 2BW's best here: said so
        assert f"plans 2bw at {best:.1f} samples/s, its best at {choice[1]}" in result.stdout
    assert abs(float(choice[3]) - float(choice[1]) / float(choice[2])) <= 0.005 + 0.06 / float(choice[2])  # rounded
    # against the fastest of them (interleaved 1F1B: planned only, counted where it fits)
    assert float(choice[2]) == max(float(rate) for rate in synchronous.groups() if rate is not None)
    refused = subprocess.run(
        [*command[:3], "recipe=gpt13b", "cluster=v100_16g_8x1", f"hydra.run.dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert refused.returncode != 0 and "no plan fits" in refused.stderr and "more devices" in refused.stderr
