"""BERT: a bidirectional encoder with a masked-LM head tied to the token embedding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .base import IGNORE_INDEX, PipelineLanguageModel
from .core import MASK_TOKEN
from .presets import from_name, pad_vocab
from .transformer import INIT_STD, Block, TokenEmbedding, normal_, ones_zeros_, zero_


@dataclass
class BERTConfig:
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 64
    vocab_size: int = pad_vocab(MASK_TOKEN + 1)
    seed: int = 1234

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> BERTConfig:
        return from_name(BERT_PRESETS, cls, name, **overrides)


BERT_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(n_layer=4, n_head=4, n_embd=64, block_size=64),
    "small": dict(n_layer=8, n_head=8, n_embd=256, block_size=128),
    # Devlin et al. 2019 (WordPiece vocabulary 30522, padded to 30528)
    "bert_base": dict(n_layer=12, n_head=12, n_embd=768, block_size=512, vocab_size=30528),
    "bert_large": dict(n_layer=24, n_head=16, n_embd=1024, block_size=512, vocab_size=30528),
}


class MLMHead(nn.Module):
    """Transform (dense, GELU, LayerNorm) then the decoder tied to the token embedding, plus a bias."""

    def __init__(self, tied_weight: nn.Parameter) -> None:
        super().__init__()
        vocab, n_embd = tied_weight.shape
        self.dense = nn.Linear(n_embd, n_embd)
        self.ln = nn.LayerNorm(n_embd)
        self.weight = tied_weight
        self.bias = nn.Parameter(torch.zeros(vocab))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.ln(F.gelu(self.dense(x))), self.weight, self.bias)

    def reset_parameters(self, generator: torch.Generator) -> None:
        normal_(self.dense.weight, INIT_STD, generator)
        zero_(self.dense.bias)
        ones_zeros_(self.ln)
        zero_(self.bias)


class BERT(PipelineLanguageModel):
    """Masked language model: ``labels`` hold the original token at masked positions, -100 elsewhere."""

    def __init__(self, config: BERTConfig | None = None, **optim: Any) -> None:
        super().__init__(config or BERTConfig(), **optim)

    def build_layers(self) -> list[nn.Module]:
        c = self.config
        embedding = TokenEmbedding(c.vocab_size, c.block_size, c.n_embd, norm=True)
        blocks = [Block(c.n_embd, c.n_head, causal=False, n_layer=c.n_layer) for _ in range(c.n_layer)]
        return [embedding, *blocks, MLMHead(embedding.wte.weight)]

    def pipeline_metrics(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        labels = batch["labels"]
        masked = labels != IGNORE_INDEX
        correct = (logits.argmax(-1) == labels) & masked
        accuracy = correct.sum().float() / masked.sum().clamp(min=1)
        return {"loss": self.pipeline_loss(logits, batch), "mlm_acc": accuracy}
