"""A long run: ``torchrun --nproc-per-node 2 run_soak.py OUT STEPS MODE DRAINS``.

``DRAINS`` is ``drains`` (validation and a checkpoint every ``EVERY`` steps: the pipeline drains each time)
or ``none`` (no validation, no checkpoint: 2BW never drains, the case that leaked every boundary send).
Every 10 steps each rank records its resident memory and the engine's bookkeeping (weight versions,
stashed and in-flight microbatches, sends not yet retired, pending losses, hyper-parameters and deferred
sums) to ``OUT/soak-rank-R.json``.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch

torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_pd2bw import PipeDream2BWStrategy  # noqa: E402
from tests.distributed.cases import Case, build_model, dataloader, dataset  # noqa: E402
from tests.distributed.harness import quiet_trainer  # noqa: E402

EVERY = 40  # with drains: validation and a checkpoint every EVERY steps


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Counters(Callback):
    def __init__(self) -> None:
        self.points: list[dict] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args) -> None:
        if trainer.global_step % 10:
            return
        strategy = trainer.strategy
        executor = strategy.engine.executor
        self.points.append(
            {
                "step": trainer.global_step,
                "rss": rss_bytes(),
                "versions": executor.versions.num_versions,
                "stashed": len(executor._stash),
                "in_flight": len(executor._microbatches) + len(executor._received) + len(executor._to_send),
                "sends": executor.link.pending_sends,
                "losses": strategy.ledger.counters()["loss_sums"] + strategy.ledger.counters()["losses_in_flight"],
                "hparams": strategy.ledger.counters()["updates_pending"],
                "step_map": strategy.ledger.counters()["batches"],
            }
        )


def main() -> None:
    out, steps, mode, drains = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4] == "drains"
    case = Case("soak", mode=mode, num_microbatches=4, steps=steps, micro_batch=16)  # 32 KiB per boundary tensor
    pl.seed_everything(0)
    counters = Counters()
    callbacks: list[Callback] = [counters]
    if drains:
        callbacks.append(
            ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=EVERY, save_top_k=2, monitor="step", mode="max")
        )
    trainer = quiet_trainer(
        PipeDream2BWStrategy(
            num_stages=2, num_microbatches=4, mode=mode, timeout=timedelta(seconds=120), failure_timeout=30
        ),
        max_steps=steps,
        val_check_interval=EVERY if drains else None,
        limit_val_batches=2 if drains else 0,
        check_val_every_n_epoch=None,
        enable_checkpointing=drains,
        callbacks=callbacks,
    )
    val = DataLoader(dataset(case), batch_size=8, shuffle=False) if drains else None
    trainer.fit(build_model(case), train_dataloaders=dataloader(case), val_dataloaders=val)
    (out / f"soak-rank-{trainer.global_rank}.json").write_text(json.dumps(counters.points))


if __name__ == "__main__":
    main()
