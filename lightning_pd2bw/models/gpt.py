"""GPT: a causal decoder with tied input/output embeddings, as pipeline layers.

Layers: ``[TokenEmbedding, Block x n_layer, LMHead]``; the head's weight *is* the embedding's
(``layers[0].wte.weight``), so the pipeline sums its gradients across the first and last stage.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .base import PipelineLanguageModel, config_from
from .core import BYTE_VOCAB, GPT_PRESETS, IGNORE_INDEX, GPTConfig, LMHead, gpt_layers

__all__ = ["BYTE_VOCAB", "GPT", "GPT_PRESETS", "GPTConfig", "LMHead"]


class GPT(PipelineLanguageModel):
    """Causal language model on bytes (or any vocabulary).

    Args:
        config: a ``GPTConfig``, its fields as a mapping (Hydra's), or None for ``GPTConfig()``.
        **optim: the optimizer and its schedule, ``PipelineLanguageModel``'s: ``optimizer`` (``"adamw"``, ``"sgd"``
            or ``"muon"``: Muon for the blocks' matrices, AdamW for the rest), ``lr``, ``weight_decay``, ``betas``,
            ``momentum`` (SGD), ``warmup_steps`` and ``max_steps`` (linear warm-up, cosine decay to
            ``min_lr_ratio`` x ``lr``).
    """

    def __init__(self, config: GPTConfig | Mapping[str, Any] | None = None, **optim: Any) -> None:
        super().__init__(config_from(config, GPTConfig) or GPTConfig(), **optim)

    def build_layers(self) -> list[nn.Module]:
        return gpt_layers(self.config)

    def pipeline_metrics(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from torchmetrics.functional.text import perplexity

        loss = self.pipeline_loss(logits, batch)
        return {"loss": loss, "ppl": perplexity(logits.float(), batch["labels"], ignore_index=IGNORE_INDEX)}
