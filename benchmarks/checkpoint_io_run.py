"""One side of the checkpoint benchmark: ``torchrun --nproc-per-node=N benchmarks/checkpoint_io_run.py save|load DIR``.

save: train a GPT (``BENCH_LAYERS`` x ``BENCH_WIDTH``, AdamW) with N stages and checkpoint it after each of
      ``SAVES`` steps, timing ``trainer.save_checkpoint`` (the time training is blocked) and the peak resident
      memory above the memory before the save; with ``--async`` the time until the checkpoint is published too.
load: resume the last of those checkpoints with N stages (a reshard when N differs) and measure the restore:
      ``strategy.load_checkpoint`` time, and the peak resident memory from the start of the load to the first
      training step (Lightning's whole restore, the optimizers' ``load_state_dict`` included) above the memory
      before it, next to the bytes this stage owns (its weights, optimizer state and masks).
Each rank writes ``DIR/{phase}-rank-R.json``.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_pd2bw import PipeDream2BWStrategy  # noqa: E402
from lightning_pd2bw.data import LMDataset, read_corpus  # noqa: E402
from lightning_pd2bw.models import GPT, GPTConfig  # noqa: E402

SEQ, BATCH, SAVES = 64, 8, 3
CONFIG = GPTConfig(
    n_layer=int(os.environ.get("BENCH_LAYERS", 8)),
    n_head=8,
    n_embd=int(os.environ.get("BENCH_WIDTH", 768)),
    block_size=SEQ,
)


def resident_peak() -> int:
    """Bytes: the process's peak resident set since the last ``reset_peak``."""
    return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def resident() -> int:
    return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: the peak resident set restarts from now


def tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


class TimeSaves(pl.Callback):
    def __init__(self, folder: Path) -> None:
        self.folder, self.saves = folder, []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        before = resident()
        reset_peak()
        start = time.perf_counter()
        trainer.save_checkpoint(self.folder / f"step={trainer.global_step}.ckpt")
        blocked = time.perf_counter() - start
        self.saves.append({"blocked_s": blocked, "peak_above_before": resident_peak() - before})


class TimeRestore(pl.Callback):
    """Wraps this run's ``strategy.load_checkpoint``; reads the peak once the restore is over (training starts)."""

    def __init__(self, strategy: PipeDream2BWStrategy) -> None:
        self.result: dict[str, Any] = {}
        load = strategy.load_checkpoint

        def timed_load(path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
            self.result["before"] = resident()
            reset_peak()
            start = time.perf_counter()
            loaded = load(path, *args, **kwargs)
            self.result["load_s"] = time.perf_counter() - start
            self.result["peak_in_load"] = resident_peak() - self.result["before"]
            masks = [s["sparsifier"]["masks"] for s in loaded.get("callbacks", {}).values() if "sparsifier" in s]
            self.result["owned_bytes"] = tensor_bytes(
                [loaded["state_dict"], [o["state"] for o in loaded.get("optimizer_states", [])], masks]
            )
            return loaded

        strategy.load_checkpoint = timed_load

    def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.result["peak_in_restore"] = resident_peak() - self.result["before"]


def main() -> None:
    phase, folder = sys.argv[1], Path(sys.argv[2])
    world = int(os.environ["WORLD_SIZE"])
    extra = {"async_checkpoint": True} if "--async" in sys.argv else {}
    strategy = PipeDream2BWStrategy(num_stages=world, num_microbatches=world, mode="flush", **extra)
    pl.seed_everything(0)
    data = DataLoader(LMDataset(read_corpus(), SEQ), BATCH, shuffle=True, drop_last=True)
    saves = TimeSaves(folder)
    restore = TimeRestore(strategy) if phase == "load" else None
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=world,
        max_steps=SAVES if phase == "save" else SAVES + 1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        callbacks=[saves] if phase == "save" else [restore],
    )
    start = time.perf_counter()
    ckpt = folder / f"step={SAVES}.ckpt" if phase == "load" else None
    trainer.fit(GPT(CONFIG), train_dataloaders=data, ckpt_path=ckpt)
    result: dict[str, Any] = {"wall_s": time.perf_counter() - start, "stage": strategy.grid.stage}
    if phase == "save":
        result["saves"] = saves.saves
        result["published"] = all((folder / f"step={n}.ckpt" / "manifest.json").is_file() for n in range(1, SAVES + 1))
    else:
        result.update(restore.result)
    (folder / f"{phase}-rank-{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
