"""The Lightning features a user checks before switching (docs/from-lightning.md's table), each run under
``strategy="pd2bw"`` and checked against what Lightning itself promises: EarlyStopping and ModelCheckpoint on
``val_loss``, LearningRateMonitor, two optimizers, a scheduler stepped per step and one per epoch; and the two
refusals (manual optimization, gradient accumulation) with their messages."""

from __future__ import annotations

import csv

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_pd2bw import PipeDream2BWStrategy
from lightning_pd2bw.data import LMDataset
from lightning_pd2bw.models import GPT, GPTConfig

SEQ, BATCH, BATCHES = 16, 4, 8  # tokens for 8 batches (the dataset's windows decide the batches an epoch)
SGD_LR, SGD_GAMMA, ADAMW_LR, ADAMW_GAMMA = 0.1, 0.5, 1e-3, 0.9


class TwoOptimizers(GPT):
    """The first half of the parameters under SGD with a per-step schedule, the rest under AdamW per epoch."""

    def configure_optimizers(self):
        params = list(self.parameters())
        sgd = torch.optim.SGD(params[: len(params) // 2], lr=SGD_LR)
        adamw = torch.optim.AdamW(params[len(params) // 2 :], lr=ADAMW_LR)
        return [
            {
                "optimizer": sgd,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(sgd, 1, SGD_GAMMA), "interval": "step"},
            },
            {
                "optimizer": adamw,
                "lr_scheduler": {
                    "scheduler": torch.optim.lr_scheduler.StepLR(adamw, 1, ADAMW_GAMMA),
                    "interval": "epoch",
                },
            },
        ]


def data() -> DataLoader:
    tokens = torch.randint(
        0, 256, (BATCH * SEQ * BATCHES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    return DataLoader(LMDataset(tokens, SEQ), batch_size=BATCH, drop_last=True)


def trainer(tmp_path, callbacks, **kwargs) -> pl.Trainer:
    return pl.Trainer(
        strategy=PipeDream2BWStrategy(num_stages=1, num_microbatches=2, failure_timeout=None),
        accelerator="cpu",
        devices=1,
        logger=CSVLogger(tmp_path / "logs"),
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **kwargs,
    )


def test_early_stopping_checkpoint_on_val_loss_lr_monitor_and_two_scheduled_optimizers(tmp_path):
    torch.manual_seed(0)
    model = TwoOptimizers(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=SEQ))
    best = ModelCheckpoint(dirpath=tmp_path / "checkpoints", monitor="val_loss", mode="min", save_top_k=1)
    # no epoch improves by 10 nats: the first check sets the reference, the second one stops (patience 1)
    early = EarlyStopping(monitor="val_loss", mode="min", patience=1, min_delta=10.0)
    fit = trainer(tmp_path, [best, early, LearningRateMonitor(logging_interval="step")], max_epochs=10)
    fit.fit(model, data(), data())
    assert fit.current_epoch == 2 and early.stopped_epoch == 1, "EarlyStopping ends the fit after 2 epochs"
    steps = 2 * len(data())  # two epochs of updates
    assert fit.global_step == steps
    sgd, adamw = fit.optimizers
    assert sgd.param_groups[0]["lr"] == pytest.approx(SGD_LR * SGD_GAMMA**steps)  # stepped after every update
    assert adamw.param_groups[0]["lr"] == pytest.approx(ADAMW_LR * ADAMW_GAMMA**2)  # after every epoch
    rows = list(csv.DictReader(open(next((tmp_path / "logs").rglob("metrics.csv")))))
    validated = [float(r["val_loss"]) for r in rows if r.get("val_loss")]
    assert len(validated) == 2 and best.best_model_score.item() == pytest.approx(min(validated))
    assert best.best_model_path and (tmp_path / "checkpoints").exists()
    logged_sgd = [float(r["lr-SGD"]) for r in rows if r.get("lr-SGD")]
    assert logged_sgd[0] == pytest.approx(SGD_LR) and logged_sgd[-1] < SGD_LR * SGD_GAMMA ** (steps - 2)
    assert any(r.get("lr-AdamW") for r in rows)


class Manual(GPT):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False


def test_manual_optimization_and_gradient_accumulation_are_refused_by_name(tmp_path):
    config = GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=SEQ)
    with pytest.raises(ValueError, match="runs the optimizer itself; set automatic_optimization=True"):
        trainer(tmp_path, [], max_steps=1).fit(Manual(config), data())
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=2\) is not used with strategy='pd2bw'"):
        trainer(tmp_path, [], max_steps=1, accumulate_grad_batches=2).fit(GPT(config), data())
