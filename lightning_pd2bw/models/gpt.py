"""GPT: a causal decoder with tied input/output embeddings, as pipeline layers.

Layers: ``[TokenEmbedding, Block x n_layer, LMHead]``; the head's weight *is* the embedding's
(``layers[0].wte.weight``), so the pipeline sums its gradients across the first and last stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .base import IGNORE_INDEX, PipelineLanguageModel
from .presets import from_name
from .transformer import Block, TokenEmbedding, ones_zeros_

BYTE_VOCAB = 256


@dataclass
class GPTConfig:
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 64  # context length
    vocab_size: int = BYTE_VOCAB
    seed: int = 1234  # initialisation seed (per-layer generators derive from it)

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> GPTConfig:
        return from_name(GPT_PRESETS, cls, name, **overrides)

    def num_parameters(self) -> int:
        """Analytic count, tied embedding once (checkable against the meta-device model)."""
        c, v, t, n = self.n_embd, self.vocab_size, self.block_size, self.n_layer
        block = 12 * c * c + 13 * c  # qkv + proj + fc + fc_proj weights, biases and two LayerNorms
        return v * c + t * c + n * block + 2 * c


GPT_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(n_layer=4, n_head=4, n_embd=64, block_size=64),  # tests: seconds on a CPU
    "small": dict(n_layer=8, n_head=8, n_embd=256, block_size=128),  # the default recipe on CPUs
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304),
    "gpt1.3b": dict(n_layer=24, n_head=16, n_embd=2048, block_size=2048, vocab_size=50304),
    "gpt2.2b": dict(n_layer=40, n_head=16, n_embd=2048, block_size=2048, vocab_size=50304),
    "gpt3.8b": dict(n_layer=48, n_head=20, n_embd=2560, block_size=2048, vocab_size=50304),
    # GPT-3 13B (Brown et al. 2020): 40 layers, d_model 5120, 40 heads, context 2048; ~12.85B params
    "gpt13b": dict(n_layer=40, n_head=40, n_embd=5120, block_size=2048, vocab_size=50304),
}


class LMHead(nn.Module):
    """Final LayerNorm and the output projection tied to the token embedding."""

    def __init__(self, tied_weight: nn.Parameter) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(tied_weight.shape[1])
        self.weight = tied_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.ln_f(x), self.weight)

    def reset_parameters(self, generator: torch.Generator) -> None:
        ones_zeros_(self.ln_f)  # the tied weight is initialised by the embedding layer


class GPT(PipelineLanguageModel):
    """Causal language model on bytes (or any vocabulary)."""

    def __init__(self, config: GPTConfig | None = None, **optim: Any) -> None:
        super().__init__(config or GPTConfig(), **optim)

    def build_layers(self) -> list[nn.Module]:
        c = self.config
        embedding = TokenEmbedding(c.vocab_size, c.block_size, c.n_embd, norm=False)
        blocks = [Block(c.n_embd, c.n_head, causal=True, n_layer=c.n_layer) for _ in range(c.n_layer)]
        return [embedding, *blocks, LMHead(embedding.wte.weight)]

    def pipeline_metrics(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from torchmetrics.functional.text import perplexity

        loss = self.pipeline_loss(logits, batch)
        return {"loss": loss, "ppl": perplexity(logits.float(), batch["labels"], ignore_index=IGNORE_INDEX)}
