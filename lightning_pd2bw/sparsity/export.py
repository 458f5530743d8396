"""Fold masks into plain weights: a sparse model with no hooks, loadable anywhere."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize, prune

from ..checkpoint.entries import by_parameter


@torch.no_grad()
def fold_masks(module: nn.Module, masks: Mapping[str, torch.Tensor] | None = None) -> int:
    """Multiply ``masks`` (parameter name -> bool keep-mask) into the weights, remove any pruning
    re-parametrisation (``torch.nn.utils.prune``'s ``weight_orig``/``weight_mask`` hooks, or
    ``parametrize``), and return the number of zero entries among the masked weights.

    Args:
        module: the model whose weights receive the masks, in place.
        masks: keep-masks by parameter name (e.g. ``checkpoint_masks(path)``); None: only the re-parametrisations
            are removed.
    """
    for submodule in module.modules():
        if parametrize.is_parametrized(submodule):
            for tensor_name in list(submodule.parametrizations):
                parametrize.remove_parametrizations(submodule, tensor_name, leave_parametrized=True)
        for hook in list(submodule._forward_pre_hooks.values()):
            if isinstance(hook, prune.BasePruningMethod):
                prune.remove(submodule, hook._tensor_name)
    params = dict(module.named_parameters())
    zeros = 0
    for name, mask in (masks or {}).items():
        if name not in params:
            raise KeyError(f"mask for {name!r} has no parameter of that name in {type(module).__name__}")
        params[name].masked_fill_(mask.logical_not().to(params[name].device), 0)
        zeros += int((params[name] == 0).sum())
    return zeros


def checkpoint_masks(checkpoint: str | Path | Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """All sparsity masks stored by sparsity callbacks in a Lightning checkpoint (a ``.ckpt`` file, a
    loaded checkpoint dict, or a pd2bw checkpoint directory: every stage's masks).

    Args:
        checkpoint: a ``.ckpt`` file, a loaded checkpoint dict or a pd2bw checkpoint directory; nothing in it
            runs code (``weights_only`` loading).
    """
    if not isinstance(checkpoint, Mapping) and Path(checkpoint).is_dir():
        from ..checkpoint.store import read_entries

        return {name[len("masks/") :]: mask for name, mask in read_entries(checkpoint, "masks/").items()}
    if isinstance(checkpoint, Mapping):
        states = [checkpoint.get("callbacks", {})]
    else:
        from ..checkpoint.safe_load import load_object  # nothing in a checkpoint runs code

        states = [load_object(Path(checkpoint)).get("callbacks", {})]
    masks: dict[str, torch.Tensor] = {}
    for callbacks in states:
        for state in callbacks.values():
            masks.update(by_parameter(state, "masks"))
    return masks
