"""SμPar (Dey et al. 2024, "Sparse maximal update parameterization") for masks of constant density: a layer of
density d starts at its initial weights x 1/sqrt(d), so the masked layer's output keeps the dense layer's scale,
and trains at an Adam-type optimizer's rate x 1/d (its fan-in is d times the dense one's). The rate needs a group of
its own per scale, made where the optimizer is built (``models/optim.py``'s ``scale_learning_rates``, called by
lightning_pd2bw's models for every callback's ``learning_rate_scales``), before the schedule and the pipeline's
update read the groups. ``SparsityCallback(density_scaling=True)`` uses both."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .allocation import layer_densities
from .masks import Sparsifier

ADAM = (torch.optim.Adam, torch.optim.AdamW)  # SμPar's rate rule is Adam's; SGD and Muon keep their rates


def rate_scales(targets: Mapping[str, nn.Parameter], allocation: str, density: float) -> dict[str, float]:
    """1 / each targeted layer's density (``allocation`` spreads ``density``), by parameter name; dense layers omitted."""
    shapes = {name: tuple(param.shape) for name, param in targets.items()}
    return {name: 1 / d for name, d in layer_densities(allocation, shapes, density).items() if d < 1}


@torch.no_grad()
def scale_initial_weights(sparsifier: Sparsifier, optimizers: Sequence[torch.optim.Optimizer], owner: str) -> None:
    """After the step-0 masks: each masked layer x 1/sqrt(its density). Refused, naming the fix, where an Adam-type
    optimizer holds a targeted weight at the module's rate (its ``configure_optimizers`` did not apply the scales)."""
    adam = [o for o in optimizers if isinstance(o, ADAM)]
    scaled = {id(p) for o in adam for g in o.param_groups if "lr_scale" in g for p in g["params"]}
    held = {id(p) for o in adam for g in o.param_groups for p in g["params"]}
    unscaled = [n for n, p in sparsifier.local.items() if id(p) in held and id(p) not in scaled]
    if unscaled:
        raise ValueError(
            f"{owner}(density_scaling=True): the optimizer holds {unscaled[:2]} at the module's rate; its "
            "configure_optimizers must give each its rate x learning_rate_scales(module) (lightning_pd2bw's models "
            "do: models/optim.py scale_learning_rates), or set density_scaling=False"
        )
    for name, mask in sparsifier.masks.items():
        sparsifier.local[name].mul_(1 / math.sqrt(float(mask.float().mean())))
