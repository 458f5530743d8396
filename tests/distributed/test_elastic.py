"""Elastic resume: under ``torchrun --max-restarts=1`` a killed rank makes the agent restart the job, which
resumes from the newest complete checkpoint (``ckpt_path="last"``) and ends equal to an uninterrupted run.

The watchdog's keys live in the agent's store, which survives restarts: they are scoped to the attempt
(``TORCHELASTIC_RESTART_COUNT``), or every restarted worker would read attempt 0's verdict and exit at once.
"""

from __future__ import annotations

import subprocess

import torch

from .launch import ROOT, torchrun_script

RUNNER = ROOT / "tests" / "distributed" / "run_elastic.py"
STEPS = 10


def torchrun(out, kill_step: int) -> subprocess.CompletedProcess:
    options = ("--max-restarts=1", "--monitor-interval=0.5")
    return torchrun_script(RUNNER, [str(out), str(kill_step), str(STEPS)], 2, 300, options, check=False)


def test_killed_rank_restarts_and_resumes_to_the_uninterrupted_result(tmp_path):
    restarted = torchrun(tmp_path / "a", kill_step=5)
    assert restarted.returncode == 0, restarted.stderr[-6000:]
    assert "rank 0 finished at step 10 (attempt 1)" in restarted.stderr, restarted.stderr[-6000:]
    assert "rank 1 finished at step 10 (attempt 1)" in restarted.stderr
    assert "Restoring states from the checkpoint path at" in restarted.stderr + restarted.stdout
    uninterrupted = torchrun(tmp_path / "b", kill_step=-1)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-6000:]
    assert "(attempt 0)" in uninterrupted.stderr
    a, b = torch.load(tmp_path / "a" / "weights.pt"), torch.load(tmp_path / "b" / "weights.pt")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6, msg=name)
