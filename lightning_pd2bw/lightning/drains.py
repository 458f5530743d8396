"""Every drain the Lightning adapter triggers, in one place.

A drain finishes every in-flight microbatch and update (``PipelineEngine.drain``); under 2BW the version rule then
restarts as at step 0, under flush it is a no-op (each batch ends drained). The strategy drains:

1. before mid-fit validation: Lightning calls ``module.on_validation_model_zero_grad`` (``zero_grad``) before
   ``on_validation_start``, when the batch in flight has half of its gradients accumulated; zeroing them made the
   drained update use only the drain's backwards (2BW with validation ended ~1e-2 away from its rule). So the
   module's hook is wrapped on the instance (``Drains.install``): drain, with gradients on, then the hook;
2. at ``on_validation_start`` (a no-op mid-fit, after 1; ``trainer.validate()`` after fit);
3. before a checkpoint is written (``StageCheckpoints.module_state_dict``: a checkpoint is always taken at a drain);
4. before any callback's ``on_train_end``: Lightning calls the callbacks' hook before the strategy's, so a drain in
   the strategy's alone let callbacks see (and tear down their optimizer hooks before) the last update, e.g. a
   sparsity callback removed its mask hook and the drain's update left pruned weights non-zero under Muon.
   ``DrainBeforeTrainEnd`` is put first in ``trainer.callbacks`` for the fit; the strategy's own
   ``on_train_end`` drains too (a no-op then);
5. on an agreed SIGTERM, before the process exits (through the checkpoint of 3, or directly; ``preemption.py``).

The engine itself drains before ``state_dict``/``load_state_dict``.
"""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback


class DrainBeforeTrainEnd(Callback):
    """4: the first callback of the fit."""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.drain()


class Drains:
    """Installs the drain triggers 1 and 4 for one trainer call and removes them at its teardown."""

    def __init__(self, drain: Callable[[], None]) -> None:
        self.drain = drain
        self._trainer: pl.Trainer | None = None
        self._module: pl.LightningModule | None = None

    def install(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if not any(isinstance(c, DrainBeforeTrainEnd) for c in trainer.callbacks):
            trainer.callbacks.insert(0, DrainBeforeTrainEnd())
        hook = module.on_validation_model_zero_grad

        def drain_then_zero_grad() -> None:
            with torch.enable_grad():  # not inside the validation loop's no-grad
                self.drain()
            hook()

        module.on_validation_model_zero_grad = drain_then_zero_grad
        self._trainer, self._module = trainer, module

    def remove(self) -> None:
        if self._trainer is not None:
            callbacks = self._trainer.callbacks
            callbacks[:] = [c for c in callbacks if not isinstance(c, DrainBeforeTrainEnd)]
        if self._module is not None and "on_validation_model_zero_grad" in vars(self._module):
            del self._module.on_validation_model_zero_grad  # the class's hook again
        self._trainer = self._module = None
