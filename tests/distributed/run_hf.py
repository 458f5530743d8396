"""Train Hugging Face models through ``HFCausalLM`` under torchrun; each rank saves its stage's weights.

    torchrun --nproc-per-node=W*2 run_hf.py OUT FAMILY:MODE [FAMILY:MODE ...]

One ``Trainer`` after another in the same processes (as a user's script may), each writing to OUT/FAMILY-MODE.
Every rank seeds its RNG differently before each ``fit``: the replicas of a stage must still start equal.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import torch

from lightning_pd2bw import PipeDream2BWStrategy
from tests.distributed.harness import quiet_trainer
from tests.distributed.hf_models import MICRO, MICROBATCHES, STAGES, STEPS, build, samples


class SaveStage(pl.Callback):
    def __init__(self, out: Path, rank: int) -> None:
        self.out, self.rank = out, rank
        self.seen: list[dict[str, torch.Tensor]] = []  # the weights callbacks see at on_train_batch_end

    def save(self, trainer: pl.Trainer, what: str) -> None:
        state = {n: p.detach().clone() for n, p in trainer.strategy.stage_parameters()}
        torch.save(state, self.out / f"{what}-rank-{self.rank}.pt")

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.save(trainer, "initial")

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: object) -> None:
        self.seen.append({n: p.detach().clone() for n, p in trainer.strategy.stage_parameters()})

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.save(trainer, "final")
        torch.save(self.seen, self.out / f"batch-end-rank-{self.rank}.pt")


def fit(out: Path, family: str, mode: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(100 + rank)  # no common seed: equal replicas come from the strategy
    loader = torch.utils.data.DataLoader(samples(family), batch_size=MICRO * MICROBATCHES, shuffle=False)
    trainer = quiet_trainer(
        PipeDream2BWStrategy(
            num_stages=STAGES,
            num_microbatches=MICROBATCHES,
            mode=mode,
            delay_correction=None,  # the reference is the plain 2BW rule, from the first step
            sync_steps=0,
            timeout=timedelta(seconds=60),
        ),
        devices=world,
        max_steps=STEPS,
        callbacks=[SaveStage(out, rank)],
    )
    trainer.fit(build(family), loader)


def main() -> None:
    torch.set_num_threads(1)
    for run in sys.argv[2:]:
        family, mode = run.split(":")
        fit(Path(sys.argv[1]) / f"{family}-{mode}", family, mode)


if __name__ == "__main__":
    main()
