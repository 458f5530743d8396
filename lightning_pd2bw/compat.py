"""Lightning internals this package relies on, in one place, each pinned by a test (tests/unit/test_compat.py).

Every name here is private to Lightning; if an upgrade moves one, the import below fails at once (loudly)
instead of a feature silently doing nothing.
"""

from __future__ import annotations

import torch
from lightning.fabric.utilities.device_dtype_mixin import _update_properties
from torch import nn


def place_module(module: nn.Module, device: torch.device) -> None:
    """Move a partially materialised module to ``device`` and tell Lightning where it is.

    Other stages' layers stay on the meta device, so ``module.to(device)`` cannot be used; ``_apply``
    moves the real tensors, and Lightning's device/dtype mixin is told the device, so that
    ``pl_module.device`` (which callbacks use for their collectives and memory reads) is the stage's
    device, not the CPU it was built on.
    """
    module._apply(lambda t: t if t.is_meta else t.to(device))
    _update_properties(module, device=torch.device(device))
