"""The LightningModule shared by GPT and BERT: the partition contract and plain training.

Under ``strategy="auto"``/``"ddp"`` the module trains as usual: ``training_step`` is the plain
composition ``pipeline_loss(layers(pipeline_inputs(batch)), batch)``. Under ``strategy="pd2bw"``
the strategy calls the three pieces itself, stage by stage.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, is_dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from .core import IGNORE_INDEX, PipelineContract
from .optim import block_matrices, build_optimizers, scale_learning_rates, warmup_cosine_schedule
from .transformer import Block

__all__ = ["IGNORE_INDEX", "PipelineLanguageModel", "config_from"]


def config_from(value: Any, cls: type) -> Any:
    """``value`` as a ``cls`` (a dataclass): the hyper-parameters store the config as a dict, which
    ``Model.load_from_checkpoint`` passes back to the constructor."""
    return cls(**value) if isinstance(value, Mapping) else value


def _config_dict(config: Any) -> Any:
    """The config as the hyper-parameters keep it: Hugging Face's ``to_dict()`` (it names the ``model_type``, which
    ``asdict`` of transformers 5's dataclass configs leaves out), a dataclass's fields, else its repr (a factory:
    pass ``config=`` again to ``load_from_checkpoint``)."""
    if hasattr(config, "to_dict"):
        return config.to_dict()
    return asdict(config) if is_dataclass(config) else repr(config)


class PipelineLanguageModel(PipelineContract, pl.LightningModule):
    """Owns ``self.layers`` (built lazily in ``configure_model``, on the meta device under pd2bw); the partition
    contract is the plain cores' (``core.PipelineContract``), around the same layers (the same state-dict keys)."""

    def __init__(
        self,
        config: Any,
        optimizer: str = "adamw",
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        momentum: float = 0.0,
        warmup_steps: int = 0,
        max_steps: int | None = None,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        self.config = config
        self.save_hyperparameters(
            {"config": _config_dict(config)}
            | {
                "optimizer": optimizer,
                "lr": lr,
                "weight_decay": weight_decay,
                "betas": list(betas),
                "momentum": momentum,
                "warmup_steps": warmup_steps,
                "max_steps": max_steps,
                "min_lr_ratio": min_lr_ratio,
            }
        )
        self.layers: nn.ModuleList | None = None

    # ------------------------------------------------------------- model
    def build_layers(self) -> list[nn.Module]:
        raise TypeError(f"{type(self).__name__} must define build_layers() returning its ordered layers")

    def configure_model(self) -> None:
        if self.layers is not None:
            return
        self.layers = nn.ModuleList(self.build_layers())
        self.init_all_layers()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        self.configure_model()
        return super().forward(idx)

    def block_layers(self) -> list[nn.Module]:
        """The transformer blocks (Muon's matrices and the default sparsity targets come from them)."""
        return [layer for layer in self.layers if isinstance(layer, Block)]

    # ------------------------------------------------------------- contract
    def pipeline_layers(self) -> nn.ModuleList:
        self.configure_model()
        return self.layers

    def pipeline_metrics(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Validation metrics of one microbatch, computed where the logits are (the last stage)."""
        return {"loss": self.pipeline_loss(logits, batch)}

    def default_sparsity_targets(self) -> list[str]:
        """What sparsity prunes by default: the Linear weights of the transformer blocks (attention
        Q/K/V and output, MLP); not embeddings, norms, biases or the heads."""
        self.configure_model()
        return [
            f"layers.{i}.{name}.weight"
            for i, layer in enumerate(self.layers)
            if isinstance(layer, Block)
            for name, module in layer.named_modules()
            if isinstance(module, nn.Linear)
        ]

    def flops_per_token(self) -> float:
        """Dense training FLOPs per token: 6 x every matrix a token meets (block Linears and the output
        projection) plus attention scores and values, 12 x layers x context x width (Kaplan et al. 2020)."""
        self.configure_model()
        c = self.config
        linear = sum(m.weight.numel() for m in self.layers.modules() if isinstance(m, nn.Linear))
        head = c.vocab_size * c.n_embd
        return 6.0 * (linear + head) + 12.0 * c.n_layer * c.block_size * c.n_embd

    # ------------------------------------------------------------- plain training
    def _plain_forward(self, batch: dict[str, torch.Tensor]) -> Any:
        inputs = self.pipeline_inputs(batch)
        return self(*inputs) if isinstance(inputs, tuple) else self(inputs)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.pipeline_loss(self._plain_forward(batch), batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        metrics = self.pipeline_metrics(self._plain_forward(batch), batch)
        self.log_dict({f"val_{k}": v for k, v in metrics.items()}, prog_bar=True, sync_dist=True)

    def learning_rate_scales(self) -> dict[int, float]:
        """Per-parameter rate factors the trainer's callbacks ask for (a callback's ``learning_rate_scales(module)``
        -> {parameter name: factor}; e.g. ``SparsityCallback(density_scaling=True)``), by ``id(param)``."""
        trainer = getattr(self, "_trainer", None)
        params = dict(self.named_parameters())
        scales: dict[int, float] = {}
        for callback in trainer.callbacks if trainer is not None else []:
            ask = getattr(callback, "learning_rate_scales", None)
            if callable(ask):
                scales |= {id(params[name]): factor for name, factor in ask(self).items() if name in params}
        return scales

    def _decay_steps(self) -> Any:
        """``max_steps``; -1 (a run bounded by epochs, Lightning's ``max_steps=-1``): the run's length as Lightning
        estimates it (``trainer.estimated_stepping_batches``), read after the warm-up, once the data are set up."""
        if self.hparams.max_steps is None or self.hparams.max_steps >= 0:
            return self.hparams.max_steps
        return lambda: self.trainer.estimated_stepping_batches

    def configure_optimizers(self) -> Any:
        """The optimizers and schedules ``model.optimizer`` etc. choose (``models/optim.py``): ``adamw``, ``sgd``, or
        ``muon`` (Muon for the blocks' weight matrices and AdamW for the rest: two optimizers, each with the
        warm-up/cosine schedule; ``strategy="pd2bw"`` steps both, Lightning's automatic optimization alone refuses
        two)."""
        hp = self.hparams
        params = [p for p in self.parameters() if p.requires_grad]
        matrices = block_matrices(self.block_layers()) if hp.optimizer == "muon" else []
        optimizers = build_optimizers(
            params, matrices, hp.optimizer, hp.lr, hp.weight_decay, tuple(hp.betas), hp.momentum
        )
        if scales := self.learning_rate_scales():
            scale_learning_rates(optimizers, scales)
        if not hp.warmup_steps and not hp.max_steps:
            return optimizers[0] if len(optimizers) == 1 else optimizers
        configured = [
            {
                "optimizer": optimizer,
                "lr_scheduler": {
                    "scheduler": warmup_cosine_schedule(
                        optimizer, hp.warmup_steps, self._decay_steps(), hp.min_lr_ratio
                    ),
                    "interval": "step",
                },
            }
            for optimizer in optimizers
        ]
        return configured[0] if len(configured) == 1 else configured
