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
    """Masked language model: ``labels`` hold the original token at masked positions, -100 elsewhere."""

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
