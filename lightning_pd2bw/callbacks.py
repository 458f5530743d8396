"""Run metrics for the progress bar and any logger: tokens/s, samples/s, learning rate, memory per stage."""

from __future__ import annotations

import resource
import sys
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback


def peak_memory_bytes(device: torch.device) -> float:
    """Peak allocated bytes on a GPU, else this process's peak resident set size."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is KiB on Linux, bytes on macOS
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale)


class RunMetrics(Callback):
    """Logs ``tokens_per_sec`` (progress bar), ``samples_per_sec``, ``lr`` and peak memory per stage.

    Throughput counts the *global* batch (all replicas) per optimizer step over the wall time since
    the previous log, so pipeline stages are not double-counted."""

    def __init__(self, global_batch_size: int, seq_len: int) -> None:
        self.global_batch_size, self.seq_len = global_batch_size, seq_len
        self._since: tuple[float, int] | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._since is None:
            self._since = (time.perf_counter(), trainer.global_step)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step % max(1, trainer.log_every_n_steps) != 0 or self._since is None:
            return
        start, step = self._since
        now = time.perf_counter()
        steps = trainer.global_step - step
        self._since = (now, trainer.global_step)
        if steps <= 0:
            return
        samples = steps * self.global_batch_size / (now - start)
        device = trainer.strategy.root_device  # the collective's device: NCCL groups take only GPU tensors
        memory = torch.tensor([peak_memory_bytes(device) / 1024**3], device=device)
        per_rank = trainer.strategy.all_gather(memory).flatten().tolist()
        metrics = {"samples_per_sec": samples, "lr": trainer.optimizers[0].param_groups[0]["lr"]}
        stages = getattr(trainer.strategy, "num_stages", 0)
        if stages:  # pd2bw: ranks 0..d-1 are replica 0's stages
            metrics |= {f"memory/stage{stage}_gib": per_rank[stage] for stage in range(stages)}
        else:
            metrics |= {f"memory/rank{rank}_gib": value for rank, value in enumerate(per_rank)}
        pl_module.log("tokens_per_sec", samples * self.seq_len, prog_bar=True, on_step=True, on_epoch=False)
        pl_module.log_dict(metrics, on_step=True, on_epoch=False)
