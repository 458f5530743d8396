"""The pipeline drains before any callback's ``on_train_end``.

Lightning calls the callbacks' ``on_train_end`` before the strategy's, so a drain in the strategy's hook
alone would let callbacks see (and tear down their optimizer hooks before) the last in-flight batch's
update: e.g. a sparsity callback removed its mask hook and the drain's update left pruned weights non-zero
under Muon. The strategy puts this callback first in ``trainer.callbacks`` for the fit.
"""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback


class DrainBeforeTrainEnd(Callback):
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.drain()

    @staticmethod
    def install(trainer: pl.Trainer) -> None:
        if not any(isinstance(c, DrainBeforeTrainEnd) for c in trainer.callbacks):
            trainer.callbacks.insert(0, DrainBeforeTrainEnd())

    @staticmethod
    def remove(trainer: pl.Trainer) -> None:
        trainer.callbacks[:] = [c for c in trainer.callbacks if not isinstance(c, DrainBeforeTrainEnd)]
