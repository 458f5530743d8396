"""The flush schedule's gradients equal those of torch.distributed.pipelining's Schedule1F1B."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("world", [2, 4])
def test_flush_gradients_equal_schedule_1f1b(tmp_path, world):
    runner = Path(__file__).with_name("run_pipelining.py")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        str(runner),
        str(tmp_path),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-6000:]
    for rank in range(world):
        grads = torch.load(tmp_path / f"grads-{rank}.pt", weights_only=True)
        assert len(grads["ours"]) == len(grads["theirs"]) == 4
        for ours, theirs in zip(grads["ours"], grads["theirs"]):
            assert ours.abs().sum() > 0
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
