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
