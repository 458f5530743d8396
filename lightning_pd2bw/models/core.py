"""Plain ``nn.Module`` cores (no Lightning): one configuration dataclass and one preset table for GPT and BERT,
their layers, the language-model loss and the seeded per-layer initialisation. ``GPTCore`` and ``BERTCore`` meet
the partition contract on their own, so a plain PyTorch loop can drive them with
``lightning_pd2bw.engine.PipelineEngine``; the LightningModules (``GPT``, ``BERT``) add the optimizer, schedule
and logging around the same layers (the same state-dict keys)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from .presets import from_name, pad_vocab
from .transformer import INIT_STD, Block, TokenEmbedding, normal_, ones_zeros_, zero_

GELUS = ("exact", "tanh")  # TransformerConfig.gelu: F.gelu's approximate="none" / "tanh"
IGNORE_INDEX = -100
MASK_TOKEN = 256  # byte vocabulary: 0..255 are bytes, 256 is [MASK] (BERT)
BYTE_VOCAB = 256


# One preset table, by family: a name is valid for the family it is listed under.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "gpt": {
        "tiny": dict(n_layer=4, n_head=4, n_embd=64, block_size=64),  # tests: seconds on a CPU
        "small": dict(n_layer=8, n_head=8, n_embd=256, block_size=128),  # the default recipe on CPUs
        "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304),
        "gpt1.3b": dict(n_layer=24, n_head=16, n_embd=2048, block_size=2048, vocab_size=50304),
        "gpt2.2b": dict(n_layer=40, n_head=16, n_embd=2048, block_size=2048, vocab_size=50304),
        "gpt3.8b": dict(n_layer=48, n_head=20, n_embd=2560, block_size=2048, vocab_size=50304),
        # GPT-3 13B (Brown et al. 2020): 40 layers, d_model 5120, 40 heads, context 2048; ~12.85B params
        "gpt13b": dict(n_layer=40, n_head=40, n_embd=5120, block_size=2048, vocab_size=50304),
    },
    "bert": {
        "tiny": dict(n_layer=4, n_head=4, n_embd=64, block_size=64),
        "small": dict(n_layer=8, n_head=8, n_embd=256, block_size=128),
        # Devlin et al. 2019 (WordPiece vocabulary 30522, padded to 30528)
        "bert_base": dict(n_layer=12, n_head=12, n_embd=768, block_size=512, vocab_size=30528),
        "bert_large": dict(n_layer=24, n_head=16, n_embd=1024, block_size=512, vocab_size=30528),
    },
}
GPT_PRESETS, BERT_PRESETS = PRESETS["gpt"], PRESETS["bert"]


@dataclass
class TransformerConfig:
    """The configuration of our transformers (GPT and BERT differ in the family's presets and default vocab); the
    fields are documented on ``GPTConfig``."""

    family: ClassVar[str] = "gpt"
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 64
    block_size: int = 64  # context length
    vocab_size: int = BYTE_VOCAB
    seed: int = 1234  # initialisation seed (per-layer generators derive from it)
    gelu: str = "exact"  # the MLP's GELU: "exact" (erf) or "tanh" (GPT-2's checkpoints: ``gelu_new``)

    def __post_init__(self) -> None:
        if self.gelu not in GELUS:
            raise ValueError(f"model.config.gelu={self.gelu!r} is not valid; valid: {', '.join(GELUS)}")

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> Any:
        return from_name(PRESETS[cls.family], cls, name, **overrides)


@dataclass
class GPTConfig(TransformerConfig):
    """GPT's configuration (presets: ``GPTConfig.from_name("small")``, ``"gpt2"``, ``"gpt13b"``; ``BERTConfig`` has the same fields).

    Args:
        n_layer: transformer blocks.
        n_head: attention heads per block (``n_embd`` divisible by it).
        n_embd: the width of the residual stream.
        block_size: the context length (positions embedded).
        vocab_size: token ids the embedding holds (bytes: 256, padded to a multiple of 64).
        seed: the initialisation seed; each layer's generator derives from it, so a layer initialises alike
            whichever stage builds it.
        gelu: the MLP's activation, ``"exact"`` (erf; ours) or ``"tanh"`` (the approximation GPT-2's checkpoints
            were trained with, ``activation_function="gelu_new"``): a Hugging Face GPT-2 directory initialises a
            model with its own.
    """

    def num_parameters(self) -> int:
        """Analytic count, tied embedding once (checkable against the meta-device model)."""
        c, v, t, n = self.n_embd, self.vocab_size, self.block_size, self.n_layer
        block = 12 * c * c + 13 * c  # qkv + proj + fc + fc_proj weights, biases and two LayerNorms
        return v * c + t * c + n * block + 2 * c


@dataclass
class BERTConfig(TransformerConfig):
    family: ClassVar[str] = "bert"
    vocab_size: int = pad_vocab(MASK_TOKEN + 1)


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


def gpt_layers(config: GPTConfig) -> list[nn.Module]:
    """``[TokenEmbedding, Block x n_layer, LMHead]``; the head's weight *is* the embedding's (tied)."""
    embedding = TokenEmbedding(config.vocab_size, config.block_size, config.n_embd, norm=False)
    blocks = [Block(config.n_embd, config.n_head, True, config.n_layer, config.gelu) for _ in range(config.n_layer)]
    return [embedding, *blocks, LMHead(embedding.wte.weight)]


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


def bert_layers(config: BERTConfig) -> list[nn.Module]:
    """``[TokenEmbedding (with LayerNorm), bidirectional Block x n_layer, MLMHead]``; the head's weight is tied."""
    embedding = TokenEmbedding(config.vocab_size, config.block_size, config.n_embd, norm=True)
    blocks = [Block(config.n_embd, config.n_head, False, config.n_layer, config.gelu) for _ in range(config.n_layer)]
    return [embedding, *blocks, MLMHead(embedding.wte.weight)]


def init_layer(layer: nn.Module, seed: int, index: int) -> None:
    """Seeded initialisation of layer ``index`` alone: the same values on any layout."""
    layer.reset_parameters(torch.Generator().manual_seed(seed * 100_003 + index))


def lm_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean cross-entropy over the labelled positions (``labels == IGNORE_INDEX`` are not counted)."""
    return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX)


def warmup_cosine(
    step: int, warmup_steps: int, max_steps: int | Callable[[], int] | None, min_lr_ratio: float
) -> float:
    """The learning-rate factor: linear warm-up, then cosine decay to ``min_lr_ratio`` at ``max_steps``: a count,
    a callable giving it (read after the warm-up only: the run's length from Lightning once its data are set up), or
    None / a count <= 0 (no decay)."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if callable(max_steps):
        max_steps = max_steps()
    if not max_steps or max_steps <= 0:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class PipelineContract:
    """The partition contract over ``self.layers`` and ``self.config``, written once: the plain cores below and the
    LightningModules (``models/base.py``) both inherit it (``pipeline_layers``, ``pipeline_inputs``,
    ``pipeline_loss``, ``init_pipeline_layer``, and ``forward`` as the plain composition of the layers)."""

    config: TransformerConfig
    layers: nn.ModuleList

    def init_pipeline_layer(self, index: int) -> None:
        """Seeded initialisation of layer ``index`` alone: the same values on any layout."""
        init_layer(self.layers[index], self.config.seed, index)

    def init_all_layers(self) -> None:
        """Every layer, unless the model was built on the meta device (a stage initialises only its own)."""
        if not any(p.is_meta for p in self.layers.parameters()):
            for index in range(len(self.layers)):
                self.init_pipeline_layer(index)

    def pipeline_layers(self) -> nn.ModuleList:
        return self.layers

    def pipeline_inputs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return batch["input_ids"]

    def pipeline_loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return lm_loss(logits, batch)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            idx = layer(idx)
        return idx


class PipelineCore(PipelineContract, nn.Module):
    """A transformer as a plain module with the partition contract. Built under
    ``engine.materialize.parameters_on_meta()`` its parameters stay on the meta device until a pipeline stage
    materialises its own layers."""

    def __init__(self, config: TransformerConfig, layers: list[nn.Module]) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(layers)
        self.init_all_layers()


class GPTCore(PipelineCore):
    """GPT (causal, tied LM head) as a plain module."""

    def __init__(self, config: GPTConfig | None = None) -> None:
        config = config or GPTConfig()
        super().__init__(config, gpt_layers(config))


class BERTCore(PipelineCore):
    """BERT (bidirectional, tied masked-LM head; ``labels`` hold the original token at masked positions, -100
    elsewhere) as a plain module."""

    def __init__(self, config: BERTConfig | None = None) -> None:
        config = config or BERTConfig()
        super().__init__(config, bert_layers(config))
