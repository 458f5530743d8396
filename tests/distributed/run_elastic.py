"""A job under torchrun's agent with restarts: ``torchrun --max-restarts 1 ... run_elastic.py OUT KILL_STEP STEPS``.

A checkpoint (``last.ckpt``) is written every 2 steps; on the first attempt rank 1 is SIGKILLed at step
KILL_STEP (-1: never). The agent then stops the other workers and starts a new attempt
(TORCHELASTIC_RESTART_COUNT=1), which resumes from the newest complete checkpoint (``ckpt_path="last"``).
Replica 0's consolidated weights are saved to ``OUT/weights.pt`` at the end.
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch

torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

from lightning_pd2bw import PipeDream2BWStrategy  # noqa: E402
from lightning_pd2bw.checkpoint import consolidate  # noqa: E402
from tests.distributed.cases import Case, build_model, dataloader  # noqa: E402
from tests.distributed.harness import quiet_trainer  # noqa: E402
from tests.distributed.run_preempt import SaveFinal  # noqa: E402


class KillOnFirstAttempt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, *args) -> None:
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first and trainer.global_rank == 1 and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    out, kill_step, steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    case = Case("elastic", mode="2bw", num_stages=2, num_microbatches=2, steps=steps)
    pl.seed_everything(0)
    trainer = quiet_trainer(
        PipeDream2BWStrategy(num_stages=2, num_microbatches=2, timeout=timedelta(seconds=300), failure_timeout=3.0),
        max_steps=steps,
        limit_val_batches=0,
        enable_checkpointing=True,
        callbacks=[
            ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=2, save_top_k=0, save_last=True),
            KillOnFirstAttempt(kill_step),
            SaveFinal(),
        ],
    )
    trainer.fit(build_model(case), train_dataloaders=dataloader(case), ckpt_path="last")
    if trainer.global_rank == 0:
        torch.save(consolidate(out / "final.ckpt"), out / "weights.pt")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    print(f"rank {trainer.global_rank} finished at step {trainer.global_step} (attempt {attempt})", file=sys.stderr)


if __name__ == "__main__":
    main()
