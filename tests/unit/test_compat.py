"""The Lightning internals ``compat.py`` relies on still behave as it assumes."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_pd2bw.compat import place_module


class TwoLayers(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))


def test_place_module_tells_lightning_the_device():
    """``pl_module.device`` follows the stage's device (a plain ``_apply`` leaves it at the CPU it was built on:
    on a GPU rank, callbacks then all-gather CPU tensors over NCCL)."""
    module = TwoLayers()
    module.layers[1].to("meta")  # another stage's layer
    place_module(module, torch.device("cpu"))
    assert module.device == torch.device("cpu")
    assert module.layers[0].weight.device.type == "cpu" and module.layers[1].weight.is_meta
    place_module(module, torch.device("meta"))  # any device other than the one it was built on
    assert module.device == torch.device("meta")


def test_a_plain_apply_does_not_update_lightnings_device():
    """Why ``place_module`` exists: if this starts failing, Lightning tracks ``_apply`` and the helper can go."""
    module = TwoLayers()
    module._apply(lambda t: t.to("meta"))
    assert module.device == torch.device("cpu")


def test_sigterm_internals_exist():
    """``preemption.py`` replaces the epoch loop's per-step SIGTERM broadcast and sets the connector's flag."""
    import signal

    from lightning_pd2bw.compat import mark_sigterm_received, replace_sigterm_check, sigterm_handler_before_lightning

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    calls = []
    replace_sigterm_check(trainer, lambda: calls.append(1))
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
    assert calls == [1]
    assert not trainer.received_sigterm
    mark_sigterm_received(trainer)
    assert trainer.received_sigterm
    before = signal.getsignal(signal.SIGTERM)
    trainer._signal_connector.register_signal_handlers()
    try:
        assert signal.getsignal(signal.SIGTERM) is not before  # Lightning's own handler is in place
        assert sigterm_handler_before_lightning(trainer) is before
    finally:
        trainer._signal_connector.teardown()


def test_fit_loop_internals_exist():
    """The fit loop's attributes ``compat`` reads or sets are still there (a rename fails here, not silently)."""
    import inspect

    from lightning.pytorch.loops.fit_loop import _FitLoop

    from lightning_pd2bw.compat import combined_train_loader, skip_lightning_backward

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    assert combined_train_loader(trainer) is None  # built when fit starts
    assert hasattr(trainer.fit_loop, "_data_source")
    # a property that reaches the automatic optimization (a plain attribute would be set and ignored)
    assert isinstance(inspect.getattr_static(_FitLoop, "_skip_backward"), property)
    skip_lightning_backward(trainer)
    assert trainer.fit_loop.epoch_loop.automatic_optimization._skip_backward is True
