"""SLURM: a preempted or timed-out job requeues itself with its own job ID, as Lightning's SLURM support does.

``#SBATCH --signal=SIGTERM@120`` sends SIGTERM before the time limit, and SLURM's preemption sends it too. The
strategy then drains, writes ``last.ckpt`` and exits 75 (``preemption.py``); here, global rank 0 runs
``scontrol requeue $SLURM_JOB_ID`` (``$SLURM_ARRAY_JOB_ID_$SLURM_ARRAY_TASK_ID`` in an array), after the checkpoint is
complete. The requeued job keeps its ID, so ``pd2bw-train``'s run folder (named after it unless
``paths.output_dir`` names one) and ``ckpt_path=last`` find the checkpoint; ``SLURM_RESTART_COUNT`` tells the
restarted job that it was started before. ``strategy.requeue=false`` (``PipeDream2BWStrategy(requeue=False)``) only
drains, checkpoints and exits. Lightning's own requeue handler (on SIGUSR1) saves from inside the signal handler,
which under a pipeline can wait in a collective its peers never reach: use SIGTERM.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys


def under_slurm() -> bool:
    """A batch job's task started by ``srun`` (Lightning's detection: ``SLURM_NTASKS`` set, the job not named
    ``bash`` or ``interactive``)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    return SLURMEnvironment.detect()


def job_id() -> str:
    """The ID ``scontrol requeue`` takes: the array task's (``ARRAYID_TASKID``) or the job's."""
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array else os.environ["SLURM_JOB_ID"]
    if not re.fullmatch(r"[0-9_]+", job):
        raise ValueError(f"SLURM job id {job!r} is not a job id: not requeued")
    return job


def requeue() -> str:
    """``scontrol requeue JOB``; returns what happened, for the log (a failure is reported, never raised: the
    checkpoint is written, and a resubmission resumes from it)."""
    job = job_id()
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"scontrol requeue {job} failed ({error}); resubmit the job: ckpt_path=last resumes"
    if result.returncode != 0:
        detail = (result.stderr or result.stdout).strip()[-300:]
        return f"scontrol requeue {job} failed (exit {result.returncode}: {detail}); resubmit: ckpt_path=last resumes"
    return f"SLURM job {job} requeued (scontrol requeue): it resumes from the checkpoint with ckpt_path=last"


def restart_count() -> int:
    """How many times SLURM (or torchrun's agent) restarted this job: above 0, the run was started before."""
    for name in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        try:
            count = int(os.environ.get(name, "0"))
        except ValueError:
            continue
        if count > 0:
            return count
    return 0


def say(text: str) -> None:
    print(f"pd2bw: {text}", file=sys.stderr, flush=True)
