"""BERT: a bidirectional encoder with a masked-LM head tied to the token embedding."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .base import IGNORE_INDEX, PipelineLanguageModel, config_from
from .core import BERT_PRESETS, BERTConfig, MLMHead, bert_layers

__all__ = ["BERT", "BERT_PRESETS", "BERTConfig", "MLMHead"]


class BERT(PipelineLanguageModel):
    """Masked language model: ``labels`` hold the original token at masked positions, -100 elsewhere.

    Args:
        config: a ``BERTConfig``, its fields as a mapping (Hydra's), or None for ``BERTConfig()``.
        **optim: the optimizer and its schedule, ``PipelineLanguageModel``'s: ``optimizer`` (``"adamw"``, ``"sgd"``
            or ``"muon"``: Muon for the blocks' matrices, AdamW for the rest), ``lr``, ``weight_decay``, ``betas``,
            ``momentum`` (SGD), ``warmup_steps`` and ``max_steps`` (linear warm-up, cosine decay to
            ``min_lr_ratio`` x ``lr``).
    """

    def __init__(self, config: BERTConfig | Mapping[str, Any] | None = None, **optim: Any) -> None:
        super().__init__(config_from(config, BERTConfig) or BERTConfig(), **optim)

    def build_layers(self) -> list[nn.Module]:
        return bert_layers(self.config)

    def pipeline_metrics(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        labels = batch["labels"]
        masked = labels != IGNORE_INDEX
        correct = (logits.argmax(-1) == labels) & masked
        accuracy = correct.sum().float() / masked.sum().clamp(min=1)
        return {"loss": self.pipeline_loss(logits, batch), "mlm_acc": accuracy}
