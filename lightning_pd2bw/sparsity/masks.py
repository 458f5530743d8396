"""Masks over a model's weights, kept exact under any optimizer (no Lightning here).

A ``Sparsifier`` owns one boolean mask per targeted weight *that lives on this process* (a pipeline
stage holds only its layers); decisions that need the whole model (a global threshold, totals for
logging) go through an ``all_reduce`` over the processes that together hold one copy of the model.
There is no second copy of the weights and no hook on the modules: the weights themselves hold the
zeros, and ``apply`` re-zeroes them (and every optimizer state tensor of the weight's shape) after
each optimizer step, which is what keeps AdamW's momentum and decoupled weight decay from moving a
pruned weight.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..checkpoint.entries import BY_PARAMETER
from .allocation import ALLOCATIONS, global_threshold, keep_count, layer_densities
from .transposable import transposable_mask

# Embeddings and the (tied) output head stay dense by default, as do norms and biases (not Linear weights).
DEFAULT_EXCLUDE = (r"(^|\.)(wte|wpe|embed\w*|lm_head|head)(\.|$)",)
KINDS = ("magnitude", "random", "rigl", "n_of_m", "dense")
AllReduce = Callable[[torch.Tensor], None]


@dataclass(frozen=True)
class MaskUpdate:
    """What a schedule asks for at one step.

    Args:
        kind: ``"magnitude"``, ``"random"``, ``"rigl"``, ``"n_of_m"`` or ``"dense"``.
        density: the overall target density (magnitude, random; ``n / m`` for n_of_m).
        drop_fraction: RigL's fraction of each layer's active weights replaced.
        n: n_of_m's weights kept per group: the ``n`` largest magnitudes of each ``m`` consecutive weights along
            the last dimension (a Linear's input features: the GEMM's reduction dimension, as 2:4 kernels group them).
        m: n_of_m's group size.
        transposable: n_of_m's groups in both directions: at most ``n`` of each ``m`` x ``m`` tile's rows and
            columns kept (``transposable.py``), so a 2:4 kernel also runs the input-gradient GEMM.
    """

    kind: str  # magnitude | random | rigl | n_of_m | dense
    density: float = 1.0  # overall target density (magnitude, random)
    drop_fraction: float = 0.0  # rigl: fraction of each layer's active weights replaced
    n: int = 0  # n_of_m: kept per group
    m: int = 0  # n_of_m: the group's size
    transposable: bool = False  # n_of_m: N:M along the rows and the columns of each m x m tile


def select_targets(
    module: nn.Module, targets: Sequence[str] | None = None, exclude: Sequence[str] = DEFAULT_EXCLUDE
) -> dict[str, nn.Parameter]:
    """Targeted weights by name, in model order, meta ones included (their shapes matter globally).

    Default: the module's ``default_sparsity_targets()`` if it has one (our GPT/BERT: the attention
    Q/K/V and output and the MLP matrices of every block), else the weight of every ``nn.Linear``;
    minus names matching ``exclude`` (embeddings, output head).

    Args:
        module: the model.
        targets: regular expressions searched in parameter names (default: as above).
        exclude: regular expressions of names left dense.
    """
    declared = getattr(module, "default_sparsity_targets", None)
    names = list(declared()) if targets is None and callable(declared) else []
    params = dict(module.named_parameters())
    if targets is None and not callable(declared):
        names = [f"{m}.weight" if m else "weight" for m, mod in module.named_modules() if isinstance(mod, nn.Linear)]
    elif targets is not None:
        names = [n for n in params if any(re.search(p, n) for p in targets)]
    chosen = {n: params[n] for n in names if n in params and not any(re.search(p, n) for p in exclude)}
    if not chosen:
        sample = ", ".join(list(params)[:6])
        raise ValueError(
            f"sparsity targets={list(targets) if targets else 'nn.Linear weights'} (exclude={list(exclude)}) match no "
            f"parameter of {type(module).__name__}; its parameters look like: {sample}. Pass targets=[regex, ...]"
        )
    return chosen


class Sparsifier:
    """Boolean masks for this process's targeted weights, updated by ``MaskUpdate`` s.

    Args:
        targets: the targeted weights by name (``select_targets``), other stages' on the meta device.
        allocation: ``"uniform"``, ``"erk"`` or ``"global"`` (as ``SparsityCallback``).
        min_layer_density: no layer is pruned below this density.
        seed: of random masks.
        all_reduce: sums a tensor over the pipeline's stages (global thresholds and counts need every stage's
            weights); None on one process.
        device: where those sums' tensors live (NCCL reads only its device's tensors; default: the targets'
            device, else the CPU). A stage may hold no target at all (an embedding alone) and still take part in
            every sum.
    """

    def __init__(
        self,
        targets: Mapping[str, nn.Parameter],
        allocation: str = "uniform",
        min_layer_density: float = 0.0,
        seed: int = 0,
        all_reduce: AllReduce | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if allocation not in ALLOCATIONS:
            raise ValueError(f"sparsity allocation={allocation!r} is not valid; valid: {', '.join(ALLOCATIONS)}")
        self.shapes = {n: tuple(p.shape) for n, p in targets.items()}
        self.local = {n: p for n, p in targets.items() if not p.is_meta}
        self.allocation = allocation
        self.min_layer_density = min_layer_density
        self.seed = seed
        self.all_reduce = all_reduce
        self._device = torch.device(device) if device is not None else None
        self.masks: dict[str, torch.Tensor] = {}  # empty: dense
        self.layer_targets = {n: 1.0 for n in self.shapes}
        self.score_dtype: torch.dtype | None = None  # magnitudes read in it (the replicas' common dtype); None: as held
        self.churn = 0  # mask entries changed since the owner last reset it (the callback: at each log)
        # called with (parameter, changed positions) after every mask change, the weights already masked
        self.on_change: list[Callable[[nn.Parameter, torch.Tensor], None]] = []

    @property
    def device(self) -> torch.device:
        if self._device is not None:
            return self._device
        return next(iter(self.local.values())).device if self.local else torch.device("cpu")

    # ------------------------------------------------------------------ updates
    @torch.no_grad()
    def update(self, step: int, change: MaskUpdate, optimizers: Iterable[torch.optim.Optimizer] = ()) -> None:
        """Recompute the masks (from the weights as they are now, and gradients for RigL) and apply them."""
        old = self.masks
        if change.kind == "dense":
            new: dict[str, torch.Tensor] = {}
            self.layer_targets = {n: 1.0 for n in self.shapes}
        elif change.kind == "magnitude":
            new = self._magnitude(change.density)
        elif change.kind == "random":
            new = self._random(step, change.density)
        elif change.kind == "rigl":
            new = self._rigl(change.drop_fraction) if old else {}
        elif change.kind == "n_of_m":
            new = self._n_of_m(change.n, change.m, change.transposable)
        else:
            raise ValueError(f"mask update kind={change.kind!r} is not valid; valid: {', '.join(KINDS)}")
        changed = {n: old.get(n, _all_true(p)) ^ new.get(n, _all_true(p)) for n, p in self.local.items()}
        self.churn += sum(int(c.sum()) for c in changed.values())
        self.masks = new
        self.apply(optimizers)
        for name, positions in changed.items():
            if positions.any():
                for listener in self.on_change:  # e.g. the delay correction forgets these entries' history
                    listener(self.local[name], positions)

    def _magnitude(self, density: float) -> dict[str, torch.Tensor]:
        self.layer_targets = layer_densities(self.allocation, self.shapes, density)
        scores = {n: self._magnitude_of(p) for n, p in self.local.items()}
        if self.allocation != "global":
            return {n: _top(s, keep_count(s.numel(), self.layer_targets[n])) for n, s in scores.items()}
        total = sum(math.prod(s) for s in self.shapes.values())
        threshold = global_threshold(list(scores.values()), round(density * total), self.all_reduce, self.device)
        masks = {}
        for name, score in scores.items():
            mask = score >= threshold
            floor = keep_count(score.numel(), self.min_layer_density)
            masks[name] = mask if int(mask.sum()) >= floor else _top(score, floor)  # no layer collapses
        return masks

    def _n_of_m(self, n: int, m: int, transposable: bool = False) -> dict[str, torch.Tensor]:
        """In each group of ``m`` consecutive weights along the last dimension, the ``n`` largest magnitudes kept
        (the same weights give the same mask on every stage and replica); ``transposable``: per ``m`` x ``m``
        tile, ``n`` in each row and each column, the pattern of largest total magnitude."""
        self.check_groups(m, transposable)
        self.layer_targets = {name: n / m for name in self.shapes}
        masks = {}
        for name, param in self.local.items():
            if transposable:
                masks[name] = transposable_mask(self._magnitude_of(param), n, m)
                continue
            groups = self._magnitude_of(param).reshape(-1, m)
            keep = torch.topk(groups, n, dim=1, sorted=False).indices
            mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, keep, True)
            masks[name] = mask.view(param.shape)
        return masks

    def check_groups(self, m: int, transposable: bool = False) -> None:
        """N:M groups need every target's last dimension (``transposable``: both, a 2-D weight) to be a multiple of
        ``m``: refused by name otherwise."""
        where = "both dimensions (a transposable mask's tiles)" if transposable else "its last dimension"
        dims = (lambda shape: shape) if transposable else (lambda shape: shape[-1:])
        uneven = {
            name: shape
            for name, shape in self.shapes.items()
            if len(shape) < 2 or (transposable and len(shape) != 2) or any(d % m for d in dims(shape))
        }
        if uneven:
            name, shape = next(iter(uneven.items()))
            raise ValueError(
                f"sparsity n_of_m: {name} {list(shape)} cannot be grouped by {m} along {where} (the GEMMs' "
                f"reduction dimensions); {len(uneven)} such target(s). Leave them out (sparsity.exclude: a regex of "
                "their names) or choose m dividing every target's features"
            )

    def _random(self, step: int, density: float) -> dict[str, torch.Tensor]:
        if self.allocation == "global":
            raise ValueError(
                "sparsity allocation='global' needs a magnitude mask; with init='random' use allocation='uniform' "
                "or allocation='erk'"
            )
        self.layer_targets = layer_densities(self.allocation, self.shapes, density)
        masks = {}
        for name, param in self.local.items():
            # the same seed on every stage and replica, whatever the layout
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()) + step)
            keep = torch.randperm(param.numel(), generator=generator, device=generator.device)[
                : keep_count(param.numel(), self.layer_targets[name])
            ]
            mask = torch.zeros(param.numel(), dtype=torch.bool, device=generator.device)
            mask[keep] = True
            masks[name] = mask.view(param.shape).to(param.device)
        return masks

    def _rigl(self, drop_fraction: float) -> dict[str, torch.Tensor]:
        """Drop the smallest active weights, grow as many inactive ones with the largest |gradient|."""
        masks = {}
        for name, param in self.local.items():
            mask = self.masks[name]
            active = int(mask.sum())
            candidates = mask.logical_not()
            count = min(int(drop_fraction * active), int(candidates.sum()))
            if count == 0 or param.grad is None:
                masks[name] = mask.clone()
                continue
            weight = self._magnitude_of(param).flatten()
            drop = torch.topk(weight.masked_fill(~mask.flatten(), math.inf), count, largest=False).indices
            grad = param.grad.detach().abs().float().flatten()
            grow = torch.topk(grad.masked_fill(mask.flatten(), -1.0), count).indices
            new = mask.clone().flatten()
            new[drop] = False
            new[grow] = True
            masks[name] = new.view(param.shape)
            param.view(-1)[grow] = 0  # grown weights start at zero (their optimizer state is zero: apply)
        return masks

    def _magnitude_of(self, param: torch.Tensor) -> torch.Tensor:
        """|param| in float32, read in ``score_dtype`` where set: every replica then ranks the same values."""
        values = param.detach() if self.score_dtype is None else param.detach().to(self.score_dtype)
        return values.abs().float()

    # ------------------------------------------------------------------ keeping masked entries at zero
    @torch.no_grad()
    def apply(self, optimizers: Iterable[torch.optim.Optimizer] = ()) -> None:
        """Zero masked weights and, in every optimizer, every state tensor shaped like the weight."""
        optimizers = list(optimizers)
        for name, mask in self.masks.items():
            param = self.local[name]
            pruned = mask.logical_not()
            param.masked_fill_(pruned, 0)
            for optimizer in optimizers:
                for value in optimizer.state.get(param, {}).values():
                    if isinstance(value, torch.Tensor) and value.shape == param.shape:
                        value.masked_fill_(pruned, 0)

    @torch.no_grad()
    def mask_gradients(self) -> None:
        """Gradients of pruned weights are not part of the sparse model (nor of its clipping norm)."""
        for name, mask in self.masks.items():
            grad = self.local[name].grad
            if grad is not None:
                grad.masked_fill_(mask.logical_not(), 0)

    # ------------------------------------------------------------------ measurement
    @torch.no_grad()
    def measure(self) -> dict[str, Any]:
        """Per-layer stored non-zeros over the whole model (summed over stages), targets, and the churn
        (fraction of targeted entries whose mask changed since ``churn`` was last reset)."""
        names = list(self.shapes)
        counts = torch.zeros(len(names) + 1, dtype=torch.float64, device=self.device)
        for index, name in enumerate(names):
            if name in self.local:
                counts[index] = torch.count_nonzero(self.local[name]).item()
        counts[-1] = self.churn
        if self.all_reduce is not None:
            self.all_reduce(counts)
        numels = {n: math.prod(s) for n, s in self.shapes.items()}
        total = sum(numels.values())
        nonzero = {n: counts[i].item() for i, n in enumerate(names)}
        return {
            "density": {n: nonzero[n] / numels[n] for n in names},
            "target": dict(self.layer_targets),
            "overall_density": sum(nonzero.values()) / total,
            "overall_target": sum(self.layer_targets[n] * numels[n] for n in names) / total,
            "churn": counts[-1].item() / total,
            "numels": numels,
        }

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """The masks and per-layer targets by parameter name (``checkpoint.entries.BY_PARAMETER``: a sharded
        checkpoint stores each mask as an entry of its own, read by the stage that holds the weight)."""
        masks = {n: m.cpu() for n, m in self.masks.items()}
        return {BY_PARAMETER: {"masks": masks, "layer_targets": dict(self.layer_targets)}, "churn": self.churn}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = {**state, **state.get(BY_PARAMETER, {})}  # before BY_PARAMETER the two maps were keys of their own
        unknown = sorted(set(state["masks"]) - set(self.local))
        if unknown:
            raise KeyError(
                f"checkpointed sparsity masks {unknown[:3]} are not weights of this process; resume with the same "
                "targets and the same pipeline layout"
            )
        self.masks = {n: m.to(self.local[n].device) for n, m in state["masks"].items()}
        self.layer_targets = dict(state["layer_targets"])
        self.churn = state["churn"]


def _all_true(param: torch.Tensor) -> torch.Tensor:
    return torch.ones(param.shape, dtype=torch.bool, device=param.device)


def _top(score: torch.Tensor, keep: int) -> torch.Tensor:
    mask = torch.zeros(score.numel(), dtype=torch.bool, device=score.device)
    mask[torch.topk(score.flatten(), keep).indices] = True
    return mask.view(score.shape)
