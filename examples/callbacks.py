"""Callbacks under ``strategy="pd2bw"`` (docs/from-lightning.md): where ``training_step``'s ``self.log`` would have
gone, and an exponential moving average of the weights over each stage's own parameters."""

from __future__ import annotations

import lightning.pytorch as pl
import torch


class LogLearningRate(pl.Callback):
    """A training metric of your own: log it from a callback (``training_step`` is not called under the pipeline)."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args) -> None:
        pl_module.log("lr", trainer.optimizers[0].param_groups[0]["lr"], on_step=True, on_epoch=False)


class StageEMA(pl.Callback):
    """An exponential moving average of the weights. Each rank averages its own stage's parameters
    (``trainer.strategy.stage_parameters()``; other stages' layers are meta placeholders in this process), so the
    average is sharded like the model, at no memory cost on the other stages."""

    def __init__(self, decay: float = 0.999) -> None:
        self.decay = decay
        self.average: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args) -> None:
        for name, parameter in trainer.strategy.stage_parameters():
            weight = parameter.detach().float()
            if name not in self.average:
                self.average[name] = weight.clone()
            else:
                self.average[name].lerp_(weight, 1 - self.decay)
