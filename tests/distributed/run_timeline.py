"""``torchrun --nproc-per-node 2 run_timeline.py OUT MODE [MODE ...]``: a tiny GPT under pd2bw with ``PipelineTrace``,
one ``Trainer`` per mode in the same processes, each writing to ``OUT/MODE``."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_pd2bw import PipeDream2BWStrategy  # noqa: E402
from lightning_pd2bw.data import LMDataset, read_corpus  # noqa: E402
from lightning_pd2bw.lightning.trace import PipelineTrace  # noqa: E402
from lightning_pd2bw.models import GPT, GPTConfig  # noqa: E402
from tests.distributed.harness import quiet_trainer  # noqa: E402

STEPS, MICROBATCHES = 4, 4


def fit(out: Path, mode: str) -> None:
    pl.seed_everything(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16), lr=1e-3)
    data = LMDataset(read_corpus(max_bytes=50_000), 16)
    trainer = quiet_trainer(
        PipeDream2BWStrategy(num_stages=2, num_microbatches=MICROBATCHES, mode=mode, sync_steps=0),
        max_steps=STEPS,
        logger=pl.loggers.CSVLogger(out, name="logs", version=0),
        log_every_n_steps=2,
        callbacks=[PipelineTrace(dirpath=str(out / "timeline"), first_step=0, num_steps=STEPS)],
        limit_val_batches=0,
    )
    trainer.fit(model, DataLoader(data, batch_size=8))


def main() -> None:
    for mode in sys.argv[2:]:
        fit(Path(sys.argv[1]) / mode, mode)


if __name__ == "__main__":
    main()
