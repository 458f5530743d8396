"""What checkpoints cost a run: the time every GPU is blocked per save, the work a failure loses, the interval.

With ``async_checkpoint=True`` a save blocks training only while each rank copies its stage's state (its float32
weights and its share of the optimizer) to host memory; the files are written in the background, and the next save
waits for them. Measured (``python benchmarks/checkpoint_staging.py --gib 4``, 2026-11-27): on one NVIDIA H200,
0.020 s per GiB blocked (pinned host buffers) and 1.42 s per GiB written in the background to the machine's local
disk; on the 2-core CPU machine 0.5-1.8 s per GiB blocked. A parallel file system shared by 64 ranks writes at its
own rate: the background figure is a local-disk one. A synchronous save blocks for the whole write.

A failure loses the work since the last complete save: half the interval on average, times every GPU of the job
(the restart's own time comes on top and is not counted here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GiB = 2**30
BLOCKING_S_PER_GIB = {"cuda": 0.020, "cpu": 1.8}  # asynchronous: the copy to host memory (measured, above)
WRITE_S_PER_GIB = 1.42  # one rank writing its share to a local NVMe disk (measured on the H200's machine)
TARGET = 0.01  # checkpointing's blocking time as a fraction of training time


@dataclass(frozen=True)
class CheckpointCost:
    rank_bytes: float  # the fullest rank's state, staged (async) or written (sync) per save
    total_bytes: float  # the checkpoint on disk (every name once)
    world_size: int
    interval: int | None  # steps between saves (the checkpoint callback's), None: no periodic saves
    step_s: float | None  # the planned step time, None: no cluster to plan for
    asynchronous: bool
    device: str = "cuda"

    @property
    def blocking_s(self) -> float:
        rate = BLOCKING_S_PER_GIB[self.device] if self.asynchronous else WRITE_S_PER_GIB
        return self.rank_bytes / GiB * rate

    @property
    def background_s(self) -> float:
        return self.rank_bytes / GiB * WRITE_S_PER_GIB if self.asynchronous else 0.0

    def overhead(self) -> float | None:
        """Blocking time over training time at the configured interval."""
        if self.interval is None or self.step_s is None:
            return None
        return self.blocking_s / (self.interval * self.step_s)

    def loss_per_failure_gpu_hours(self) -> float | None:
        if self.interval is None or self.step_s is None:
            return None
        return self.interval / 2 * self.step_s * self.world_size / 3600

    def shortest_interval(self) -> int | None:
        """The fewest steps between saves that keep the blocking time under ``TARGET`` of training and let each
        background write finish before the next save (which would otherwise wait for it)."""
        if self.step_s is None:
            return None
        return max(1, math.ceil(self.blocking_s / (TARGET * self.step_s)), math.ceil(self.background_s / self.step_s))

    @property
    def preemption_s(self) -> float | None:
        """What SIGTERM (a time limit, a preemption) needs before the job is killed: the step in progress, the drain
        (at most one more step of the pipeline's tail) and the fullest rank's synchronous save at the local-disk
        rate (``reliability``: a preempted run always writes ``last.ckpt`` synchronously)."""
        if self.step_s is None:
            return None
        return 2 * self.step_s + self.rank_bytes / GiB * WRITE_S_PER_GIB

    def preemption_text(self) -> str:
        """``preemption: ...``: the time SIGTERM needs and the ``--signal`` lead that leaves twice that (whole
        minutes), for SLURM's ``#SBATCH --signal=SIGTERM@N``."""
        needed = self.preemption_s
        if needed is None:
            return "preemption: the step time needs a cluster (+cluster=NAME)"
        lead = 60 * math.ceil(2 * needed / 60)
        return (
            f"preemption: {needed:.0f} s from SIGTERM to exit (a step, the drain, {self.rank_bytes / GiB:.1f} GiB "
            f"written synchronously at the local-disk rate): #SBATCH --signal=SIGTERM@{lead} leaves twice that; a "
            "shared file system's rate for 8 ranks of a node scales the write"
        )

    def describe(self) -> str:
        how = "async" if self.asynchronous else "synchronous"
        text = (
            f"checkpoint: {self.total_bytes / GiB:,.1f} GiB per save ({self.rank_bytes / GiB:.1f} GiB on the fullest "
            f"rank); {how}: every rank blocked {self.blocking_s:.2f} s per save"
        )
        if self.asynchronous:
            text += f", then ~{self.background_s:.0f} s of writing in the background (local-disk rate)"
        if self.step_s is None:
            return text + "; the step time needs a cluster (+cluster=NAME) for the rest"
        text += f"; planned step {self.step_s:.2f} s"
        if self.interval is not None:
            text += (
                f"; every {self.interval} steps: {self.overhead():.3%} of training time blocked, a failure loses "
                f"{self.interval // 2} steps on average ({self.loss_per_failure_gpu_hours():,.1f} GPU-hours)"
            )
        return text + f"; under {TARGET:.0%} blocked from every {self.shortest_interval()} steps"
