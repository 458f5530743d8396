"""Materialise a stage's layers from the meta device, keeping shared parameters shared."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn


def materialize(layers: Sequence[nn.Module], device: torch.device) -> bool:
    """Give every meta parameter/buffer of ``layers`` real (uninitialised) storage on ``device``.

    A parameter referenced by several modules gets one new tensor, re-tied everywhere.
    Returns True when anything was on the meta device (the caller then initialises it).
    """
    replaced: dict[int, nn.Parameter] = {}
    found = False
    for layer in layers:
        for module in layer.modules():
            for name, param in list(module._parameters.items()):
                if param is None or not param.is_meta:
                    continue
                found = True
                if id(param) not in replaced:
                    replaced[id(param)] = nn.Parameter(torch.empty_like(param, device=device), param.requires_grad)
                setattr(module, name, replaced[id(param)])
            for name, buffer in list(module._buffers.items()):
                if buffer is not None and buffer.is_meta:
                    found = True
                    module._buffers[name] = torch.empty_like(buffer, device=device)
    return found


def release(layer: nn.Module) -> None:
    """Drop a layer this stage does not run: its tensors move to the meta device (no memory)."""
    layer.to("meta")
