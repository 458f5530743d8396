"""The base of the sparsity callbacks (step-based, exact, resumable): where masks are applied, kept and removed;
the schedules themselves are ``callbacks.py``.

Where things happen, identical under a single device, DDP and ``strategy="pd2bw"`` (both modes):

- ``on_train_start``: targets are selected on the whole model (other stages' layers are on the meta
  device under pd2bw: their shapes still count for ERK and the global threshold); a fresh run applies
  the step-0 masks before the first forward; a resumed run reinstalls its checkpointed masks.
- ``on_before_optimizer_step`` of optimizer step ``k`` (after gradients are reduced over replicas,
  before clipping): if the schedule updates at ``k``, masks are recomputed from the weights being
  updated and the gradients (RigL); gradients of pruned weights are zeroed. Under pd2bw this runs
  inside the pipeline's update, on the weight version being written, so in 2BW a mask change applies
  from the next weight version on and never touches a version that in-flight microbatches use.
- an optimizer step post-hook: masked weights and every optimizer-state tensor of the weight's shape
  are zeroed (AdamW moments, momentum buffers), so nothing regrows; the step counter advances.

Sparse-to-dense (SPDF): ``dense_from_step=K`` removes the masks at step K (the pruned weights restart
from zero with zero optimizer state). ``rewarmup_steps=W`` scales the learning rate by ``(k - K + 1) / W``
for the ``W`` steps from any mask change at step ``K >= 1`` (a pruning update, a RigL update, the switch
to dense). ``dense_lr=F`` gives the dense phase a learning-rate schedule of its own, as SPDF's separate fine-tuning
has: from step K each group's rate is ``F`` x its peak (the scheduler's ``initial_lr``), cosine-decayed to a tenth
of that at ``trainer.max_steps`` (the re-warm-up on top), instead of the run's schedule's tail.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from . import schedules
from .allocation import ALLOCATIONS
from .density_scaling import rate_scales, scale_initial_weights
from .masks import DEFAULT_EXCLUDE, MaskUpdate, Sparsifier, select_targets

INITS = ("random", "magnitude")


@runtime_checkable
class SplitModel(Protocol):
    """What a strategy that splits the model over processes offers the sparsity callbacks (``strategy="pd2bw"``):
    the one joint between them. Any other strategy holds the whole model on every process."""

    def all_reduce_over_stages(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the processes that together hold one model (global thresholds, counts)."""

    def restart_history(self, parameter: nn.Parameter, positions: torch.Tensor) -> None:
        """Entries set from outside the update (a mask change): a delay correction's history forgets them."""

    def replicated_dtype(self) -> torch.dtype | None:
        """The dtype in which every replica holds the weights alike (bf16 where only a weight's owner keeps its
        float32 master); masks are decided from the weights in it, so every replica decides the same. None: any."""


class SparsityCallback(Callback):
    """Base class: subclasses say what happens at each optimizer step (``plan``).

    Args:
        allocation: how the target sparsity is spread over the layers: ``"uniform"`` (each layer alike),
            ``"erk"`` (Erdos-Renyi-Kernel: denser small layers) or ``"global"`` (one magnitude threshold).
        targets: regular expressions of the parameter names to sparsify (default: every weight matrix).
        exclude: regular expressions of names never sparsified (default: embeddings, norms, biases, the head).
        min_layer_density: no layer is pruned below this density.
        dense_from_step: from this step on the masks are dropped and training continues dense (SPDF).
        rewarmup_steps: after each mask change the learning rate re-warms linearly over this many steps.
        dense_lr: with ``dense_from_step``: the dense phase's own peak learning rate, a multiple of the schedule's
            peak, cosine-decayed to a tenth of it at the end of training (None: the run's schedule goes on).
        density_scaling: SμPar (Dey et al. 2024) for a sparse-from-scratch mask of constant density (static, RigL):
            each targeted layer of density d starts at its initial weights x 1/sqrt(d) (the masked layer's output
            keeps the dense layer's scale) and trains at the Adam-type optimizer's rate x 1/d (its own parameter
            group; the module's ``configure_optimizers`` applies ``learning_rate_scales``, as lightning_pd2bw's models
            do). SGD and Muon keep their rates.
        seed: of random masks (the same on every rank).
        log_per_layer: log each layer's density (grouped under ``sparsity_per_layer``).
    """

    reads_gradients: str | bool = False  # mask changes read every gradient (RigL's: why, said in messages)
    constant_density = False  # each layer's density is fixed from step 0 (static, RigL): density_scaling applies

    def __init__(
        self,
        allocation: str = "uniform",
        targets: Sequence[str] | None = None,
        exclude: Sequence[str] = DEFAULT_EXCLUDE,
        min_layer_density: float = 0.01,
        dense_from_step: int | None = None,
        rewarmup_steps: int = 0,
        dense_lr: float | None = None,
        density_scaling: bool = False,
        seed: int = 0,
        log_per_layer: bool = True,
    ) -> None:
        _check_choice("allocation", allocation, ALLOCATIONS)
        _check_range("min_layer_density", min_layer_density, 0.0, 1.0)
        if dense_from_step is not None and dense_from_step < 1:
            raise ValueError(f"{type(self).__name__}(dense_from_step={dense_from_step}) must be >= 1 (or None)")
        if rewarmup_steps < 0:
            raise ValueError(f"{type(self).__name__}(rewarmup_steps={rewarmup_steps}) must be >= 0")
        if dense_lr is not None and (dense_from_step is None or dense_lr <= 0):
            raise ValueError(
                f"{type(self).__name__}(dense_lr={dense_lr}, dense_from_step={dense_from_step}): dense_lr is the "
                "dense phase's peak rate; it needs dense_from_step and a value > 0"
            )
        self.allocation = allocation
        self.targets = list(targets) if targets is not None else None
        self.exclude = list(exclude)
        self.min_layer_density = min_layer_density
        self.dense_from_step = dense_from_step
        self.rewarmup_steps = rewarmup_steps
        if density_scaling and (not self.constant_density or dense_from_step is not None or allocation == "global"):
            raise ValueError(
                f"{type(self).__name__}(density_scaling=True) needs a mask of constant, known density from step 0: "
                "StaticSparsity or RigL, without dense_from_step, with allocation 'uniform' or 'erk'"
            )
        self.dense_lr = dense_lr
        self.density_scaling = density_scaling
        self.end_step_of_run: int | None = None  # trainer.max_steps (the dense phase's schedule ends there)
        self.seed = seed
        self.log_per_layer = log_per_layer
        self.step = 0  # optimizer steps taken
        self.sparsifier: Sparsifier | None = None
        self._pending: dict[str, Any] | None = None
        self._handles: list[Any] = []
        self._optimizers: list[torch.optim.Optimizer] = []
        self._saved_lrs: dict[int, list[float]] = {}  # id(optimizer) -> its groups' lrs before the re-warm-up scaling

    # ------------------------------------------------------------------ the schedule
    def plan(self, step: int) -> MaskUpdate | None:
        """The mask change before optimizer step ``step`` (step 0: before the first forward), or None."""
        raise NotImplementedError(f"{type(self).__name__} must define plan(step) -> MaskUpdate | None")

    def change_at(self, step: int) -> MaskUpdate | None:
        if self.dense_from_step is not None and step >= self.dense_from_step:
            return MaskUpdate("dense") if step == self.dense_from_step else None
        return self.plan(step)

    def lr_factor(self, step: int) -> float:
        """The learning-rate multiplier of optimizer step ``step``: ``(step - k + 1) / rewarmup_steps`` for the
        ``rewarmup_steps`` steps from a mask change at step ``k >= 1`` (a pruning update, RigL's drop-and-grow,
        SPDF's switch to dense), else 1. Step 0's masks precede training: the scheduler's warm-up covers them."""
        for changed in range(step, max(0, step - self.rewarmup_steps), -1):
            if self.change_at(changed) is not None:
                return schedules.rewarmup_factor(step, changed, self.rewarmup_steps)
        return 1.0

    def learning_rate(self, step: int, lr: float, peak: float) -> float:
        """The rate optimizer step ``step`` uses in a group the run's schedule gives ``lr`` there and peaks at
        ``peak``: the dense phase's own (``dense_lr``) or ``lr``, times the re-warm-up (``lr_factor``)."""
        own = self.dense_phase_lr(step, peak)
        return (lr if own is None else own) * self.lr_factor(step)

    def dense_phase_lr(self, step: int, peak: float) -> float | None:
        """The dense phase's own rate at ``step`` for a group whose schedule peaks at ``peak`` (``dense_lr``), None
        before the phase or without ``dense_lr``."""
        if self.dense_lr is None or step < self.dense_from_step:
            return None
        if self.end_step_of_run is None or self.end_step_of_run <= self.dense_from_step:
            raise ValueError(
                f"{type(self).__name__}(dense_lr={self.dense_lr}) needs the run's last step after dense_from_step="
                f"{self.dense_from_step} (trainer.max_steps={self.end_step_of_run}): set trainer.max_steps"
            )
        return schedules.restart_lr(step, self.dense_from_step, self.end_step_of_run, self.dense_lr * peak)

    def learning_rate_scales(self, module: nn.Module) -> dict[str, float]:
        """``density_scaling``'s rate factor by targeted parameter name (``density_scaling.py``), else none."""
        if not self.density_scaling:
            return {}
        return rate_scales(select_targets(module, self.targets, self.exclude), self.allocation, 1 - self.sparsity)

    # ------------------------------------------------------------------ engine-level use (also the test references)
    def build(self, module: nn.Module, all_reduce: Any = None, device: torch.device | None = None) -> Sparsifier:
        targets = select_targets(module, self.targets, self.exclude)
        return Sparsifier(targets, self.allocation, self.min_layer_density, self.seed, all_reduce, device)

    def before_step(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Before optimizer step ``self.step``, gradients ready: scheduled mask change, then mask the gradients."""
        if self.step > 0 and (change := self.change_at(self.step)) is not None:
            self.sparsifier.update(self.step, change, optimizers)
        self.sparsifier.mask_gradients()

    def after_step(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.sparsifier.apply(optimizers)
        self.step += 1

    def horizon(self) -> dict[str, int]:
        """The step settings this callback's schedule was computed for (a checkpoint records them and a resume
        compares them: ``lightning/checkpoints.py``)."""
        return {
            f"{type(self).__name__}.{key}": value
            for key, value in vars(self).items()
            if key.endswith(("_step", "_steps", "_interval")) and isinstance(value, int)
        }

    # ------------------------------------------------------------------ Lightning hooks
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        split = trainer.strategy if isinstance(trainer.strategy, SplitModel) else None  # pd2bw: stages split the model
        reduce = split.all_reduce_over_stages if split is not None else None
        self.sparsifier = self.build(pl_module, reduce, trainer.strategy.root_device)  # counts live where NCCL reads
        if split is not None:  # a mask change restarts the delay correction's history
            self.sparsifier.on_change.append(split.restart_history)
            self.sparsifier.score_dtype = split.replicated_dtype()  # the replicas' masks agree
        self._optimizers = list(trainer.optimizers)
        self.end_step_of_run = trainer.max_steps if trainer.max_steps > 0 else None
        if self._pending is not None:
            self.sparsifier.load_state_dict(self._pending)
            self._pending = None
            self.sparsifier.apply(self._optimizers)
        elif self.step == 0 and (change := self.change_at(0)) is not None:
            self.sparsifier.update(0, change, self._optimizers)
            if self.density_scaling:
                scale_initial_weights(self.sparsifier, self._optimizers, type(self).__name__)
        for optimizer in self._optimizers:
            self._handles.append(optimizer.register_step_pre_hook(self._scale_lr))
            self._handles.append(optimizer.register_step_post_hook(self._after_optimizer_step))

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if optimizer is self._optimizers[0]:  # once per update, whatever the number of optimizers
            self.before_step(self._optimizers)

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        saved = self._saved_lrs.pop(id(optimizer), None)
        if saved is not None:
            for group, lr in zip(optimizer.param_groups, saved):
                group["lr"] = lr
        if optimizer is self._optimizers[-1]:
            self.after_step(self._optimizers)

    def _scale_lr(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        rates = [self.learning_rate(self.step, g["lr"], g.get("initial_lr", g["lr"])) for g in optimizer.param_groups]
        if any(rate != group["lr"] for rate, group in zip(rates, optimizer.param_groups)):
            self._saved_lrs[id(optimizer)] = [group["lr"] for group in optimizer.param_groups]
            for group, rate in zip(optimizer.param_groups, rates):
                group["lr"] = rate

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.sparsifier is None or trainer.global_step % max(1, trainer.log_every_n_steps) != 0:
            return
        pl_module.log_dict(self.metrics(pl_module), on_step=True, on_epoch=False)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.sparsifier is not None:
            self._record_final(trainer, pl_module)

    def _record_final(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The trained weights' sparsity, measured once more at the end: the last log can precede the last mask
        change (it is every ``log_every_n_steps``, and under 2BW the last batch's update lands only at the strategy's
        drain, which ``DrainBeforeTrainEnd`` runs before this hook). Lightning refuses ``self.log`` here, so the
        values go to ``trainer.callback_metrics`` (what a run's summary reads) and to the loggers directly."""
        metrics = self.metrics(pl_module)
        final = trainer.callback_metrics  # read first: it refreshes itself from the last logged values
        final.update({key: torch.tensor(value) for key, value in metrics.items()})
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    # ------------------------------------------------------------------ logging
    def metrics(self, module: nn.Module) -> dict[str, float]:
        """Densities from the stored weights (per layer and overall), churn, training FLOPs vs dense."""
        measured = self.sparsifier.measure()
        self.sparsifier.churn = 0  # churn is reported per logging interval
        out = {
            "sparsity/density": measured["overall_density"],
            "sparsity/target_density": measured["overall_target"],
            "sparsity/churn": measured["churn"],
            "sparsity/flops_ratio": flops_ratio(module, measured["density"], measured["numels"]),
            "sparsity/lr_factor": self.lr_factor(self.step),
        }
        if self.log_per_layer:
            for name, density in measured["density"].items():
                out[f"sparsity/density/{name}"] = density
                out[f"sparsity/target/{name}"] = measured["target"][name]
        return out

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        state = {"step": self.step, "seed": self.seed}
        if self.sparsifier is not None:
            state["sparsifier"] = self.sparsifier.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]
        self.seed = state_dict["seed"]
        self._pending = state_dict.get("sparsifier")


def flops_ratio(module: nn.Module, densities: dict[str, float], numels: dict[str, int]) -> float:
    """Training FLOPs per token of the sparse model over the dense one.

    Dense FLOPs come from ``module.flops_per_token()`` when the module defines it (our GPT/BERT count
    attention scores and the LM head, which stay dense), else ``6 x`` the ``nn.Linear`` weights. A
    masked weight saves its ``6`` FLOPs per token (forward, input gradient, weight gradient).

    Args:
        module: the model (its ``flops_per_token()`` if it has one).
        densities: each targeted weight's density, by parameter name.
        numels: each targeted weight's element count, by parameter name.
    """
    counter = getattr(module, "flops_per_token", None)
    if callable(counter):
        dense = float(counter())
    else:
        dense = 6.0 * sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))
    saved = 6.0 * sum((1 - densities[n]) * numels[n] for n in densities)
    return (dense - saved) / dense


def _check_choice(key: str, value: str, valid: Sequence[str]) -> None:
    if value not in valid:
        raise ValueError(f"sparsity {key}={value!r} is not valid; valid: {', '.join(valid)}")


def _check_range(key: str, value: float, low: float, high: float, closed_high: bool = True) -> None:
    ok = low <= value <= high if closed_high else low <= value < high
    if not ok:
        bracket = "]" if closed_high else ")"
        raise ValueError(f"sparsity {key}={value} must be in [{low}, {high}{bracket}")


def _check_init_allocation(init: str, allocation: str) -> None:
    if init == "random" and allocation == "global":
        raise ValueError(
            "sparsity init='random' with allocation='global': a global threshold needs magnitudes. Use "
            "init='magnitude', or allocation='uniform' / 'erk'"
        )
