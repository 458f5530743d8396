"""SLURM without SLURM (issue 60): ``pd2bw-train`` started as ``srun`` starts it (one process per task, srun's
environment: ``SLURM_JOB_ID``, ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_RESTART_COUNT``, ...) with a recording
``scontrol`` on ``PATH``. SIGTERM (the time limit's ``--signal=SIGTERM@120``, or preemption) drains, writes
``last.ckpt`` and requeues the job with its own ID; the requeued job (same ID, ``SLURM_RESTART_COUNT=1``) resumes
from the first's step with ``ckpt_path=last`` and ends equal to an uninterrupted run. A requeued job that finds no
checkpoint refuses instead of starting over."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning_pd2bw.checkpoint import consolidate, newest_checkpoint, read_manifest
from lightning_pd2bw.observe.watchdog import EXIT_CODE

from .launch import ROOT, free_port

pytestmark = pytest.mark.full

STEPS, SIGNAL_STEP = 8, 3
RUN = [
    "model=gpt_tiny",
    "data.seq_len=32",
    "global_batch_size=8",
    "micro_batch_size=2",
    f"trainer.max_steps={STEPS}",
    "trainer.val_check_interval=4",
    "trainer.limit_val_batches=1",
    "trainer.enable_progress_bar=false",
    "strategy=pd2bw_flush",  # exact: the resumed run equals the uninterrupted one without matching its drains
    "logger=csv",
    "ckpt_path=last",
]
PREEMPT = [
    "+callbacks.preempt._target_=tests.distributed.run_preempt.PreemptAt",
    "+callbacks.preempt.who=all",
    f"+callbacks.preempt.step={SIGNAL_STEP}",
    "+callbacks.preempt.moment=batch",
]


def srun(tmp_path: Path, job: str, restart: int, extra: list[str]) -> list[subprocess.CompletedProcess]:
    """Two tasks of job ``job`` on one node, as ``srun --ntasks-per-node=2`` starts them."""
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.parent.mkdir(exist_ok=True)
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol.log"}\n')
    scontrol.chmod(0o755)
    port = str(free_port())
    processes = []
    for task in range(2):
        env = dict(
            os.environ,
            PATH=f"{scontrol.parent}:{os.environ['PATH']}",
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(ROOT),
            WANDB_MODE="offline",
            SLURM_JOB_ID=job,
            SLURM_JOB_NAME="gpt",
            SLURM_NTASKS="2",
            SLURM_NTASKS_PER_NODE="2",
            SLURM_NNODES="1",
            SLURM_NODEID="0",
            SLURM_NODELIST="127.0.0.1",
            SLURM_PROCID=str(task),
            SLURM_LOCALID=str(task),
            SLURM_RESTART_COUNT=str(restart),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "PD2BW_RUN_ID", "TORCHELASTIC_RUN_ID"):
            env.pop(name, None)
        command = [sys.executable, "-m", "lightning_pd2bw.cli.train", *RUN, "trainer.devices=2", *extra]
        out, err = (tmp_path / f"task{task}-{job}-{restart}.{kind}" for kind in ("out", "err"))
        with out.open("w") as stdout, err.open("w") as stderr:  # files: a full pipe would stop a task
            processes.append((subprocess.Popen(command, env=env, cwd=tmp_path, stdout=stdout, stderr=stderr), out, err))
    results, deadline = [], time.monotonic() + 240
    try:
        for process, out, err in processes:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
            results.append(
                subprocess.CompletedProcess(process.args, process.returncode, out.read_text(), err.read_text())
            )
    finally:
        for process, _, _ in processes:
            if process.poll() is None:
                process.kill()
    return results


def logs(results) -> str:
    return "\n".join(
        f"--- task {i} rc={r.returncode}\n{r.stdout[-1500:]}\n{r.stderr[-3000:]}" for i, r in enumerate(results)
    )


def weights(run: Path) -> dict[str, torch.Tensor]:
    newest = newest_checkpoint(run / "checkpoints")
    assert newest is not None and read_manifest(newest)["global_step"] == STEPS, newest
    return consolidate(newest)


def test_a_preempted_slurm_job_requeues_itself_and_resumes_to_the_uninterrupted_run(tmp_path):
    first = srun(tmp_path, "4242", 0, PREEMPT)
    assert all(r.returncode == EXIT_CODE for r in first), logs(first)
    assert (tmp_path / "scontrol.log").read_text().split("\n")[0] == "requeue 4242", "rank 0 requeued its own job ID"
    run = tmp_path / "outputs" / "slurm-4242"  # the run folder is named after the job: a requeue finds it
    stopped = read_manifest(run / "checkpoints" / "last.ckpt")["global_step"]
    assert SIGNAL_STEP < stopped < STEPS, stopped

    requeued = srun(tmp_path, "4242", 1, [])
    assert all(r.returncode == 0 for r in requeued), logs(requeued)
    assert f"ckpt_path=last: resuming from {run / 'checkpoints'}" in requeued[0].stdout, logs(requeued)
    assert len((tmp_path / "scontrol.log").read_text().splitlines()) == 1, "a job that finished is not requeued"

    uninterrupted = srun(tmp_path, "5151", 0, [])
    assert all(r.returncode == 0 for r in uninterrupted), logs(uninterrupted)
    a, b = weights(run), weights(tmp_path / "outputs" / "slurm-5151")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6, msg=name)


def test_a_requeued_job_without_a_checkpoint_refuses_to_start_over(tmp_path):
    """SLURM_RESTART_COUNT=1 and nothing in the run's checkpoint folder: refused naming the folder, within seconds."""
    results = srun(tmp_path, "777", 1, ["trainer.max_steps=2"])
    for result in results:
        assert result.returncode not in (0, EXIT_CODE), logs(results)
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("pd2bw-train: bad configuration: ckpt_path=last: no complete checkpoint in"), last
        assert "slurm-777/checkpoints" in last and "restart 1 of this job" in last
    assert not (tmp_path / "scontrol.log").exists()
