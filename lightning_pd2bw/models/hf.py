"""Hugging Face ``transformers`` decoder-only language models as pipelines, without a hand-written wrapper.

    from transformers import GPT2Config
    from lightning_pd2bw.models.hf import HFCausalLM

    model = HFCausalLM(GPT2Config(n_layer=12, n_embd=768), lr=3e-4)   # or a config dict, or a factory
    Trainer(strategy="pd2bw", devices=4).fit(model, data)            # batches: {"input_ids": ...}

``HFCausalLM`` builds the model from its config (on the meta device under ``strategy="pd2bw"``: each stage
materialises and initialises its own layers with the model's ``_init_weights``) and derives the partition
contract from it: the token (and position) embeddings, each decoder block, the final norm with the LM head. A
block is called as the model's own forward calls it, with the causal mask, position ids and rotary position
embeddings recomputed on its stage from the hidden states (nothing but activations crosses the stages; an
``attention_mask`` in the batch travels along). Tied embeddings stay tied (the strategy sums their gradients).
The loss is Hugging Face's: cross-entropy of the logits at t against ``labels`` (default: ``input_ids``) at t+1,
ignoring -100; with ``shift_labels=False`` the labels are already aligned (this project's datasets).

Supported families (``FAMILIES``): GPT-2 and the Llama layout (Llama, Mistral, Qwen2, Qwen3) as causal LMs, BERT
as a masked LM (``HFMaskedLM``). Adding one is a ``Family`` entry: where the base model, its embeddings, blocks,
final norm, rotary embedding and head live, and whether attention is causal.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .base import IGNORE_INDEX, PipelineLanguageModel


@dataclass(frozen=True)
class Family:
    """Where a family's parts live: attribute paths (dotted) on the base model, ``head`` on the task model."""

    base: str  # the base model's attribute on the task model (*ForCausalLM, *ForMaskedLM)
    tokens: str  # token embedding (or the whole embeddings module, called with the token ids)
    blocks: str  # the blocks (a ModuleList)
    norm: str | None = None  # final norm
    positions: str | None = None  # learned position embedding, added (GPT-2's wpe)
    dropout: str | None = None  # after the embeddings
    rotary: str | None = None  # rotary position embedding, recomputed in every block
    head: str | None = None  # the task head on the task model (default: its output embeddings)
    causal: bool = True  # causal (decoder) or bidirectional (encoder) attention mask


LLAMA = Family(base="model", tokens="embed_tokens", blocks="layers", norm="norm", rotary="rotary_emb")
FAMILIES: dict[str, Family] = {
    "gpt2": Family(base="transformer", tokens="wte", blocks="h", norm="ln_f", positions="wpe", dropout="drop"),
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": LLAMA,
    "qwen3": LLAMA,
    "bert": Family(base="bert", tokens="embeddings", blocks="encoder.layer", head="cls", causal=False),
}


def _part(module: nn.Module, path: str | None) -> nn.Module | None:
    if path is None:
        return None
    for name in path.split("."):
        module = getattr(module, name)
    return module


def _with_mask(hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> Any:
    return hidden if attention_mask is None else (hidden, attention_mask)


class Embeddings(nn.Module):
    """Layer 0: token embeddings (+ learned positions, dropout)."""

    def __init__(self, tokens: nn.Module, positions: nn.Module | None, dropout: nn.Module | None) -> None:
        super().__init__()
        self.tokens, self.positions, self.dropout = tokens, positions, dropout

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Any:
        hidden = self.tokens(input_ids)
        if self.positions is not None:
            hidden = hidden + self.positions(torch.arange(input_ids.shape[1], device=input_ids.device))
        if self.dropout is not None:
            hidden = self.dropout(hidden)
        return _with_mask(hidden, attention_mask)


class DecoderBlock(nn.Module):
    """One decoder block, called with what the base model's forward would pass it (no cache)."""

    def __init__(self, block: nn.Module, config: Any, rotary: nn.Module | None, causal: bool = True) -> None:
        super().__init__()
        self.block = block
        self.rotary = copy.deepcopy(rotary)  # buffers only; each stage holds its blocks' copies
        self.causal = causal
        self.__dict__["config"] = config  # not a module

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Any:
        from transformers.masking_utils import create_bidirectional_mask, create_causal_mask

        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        if self.causal:
            mask = create_causal_mask(
                config=self.config,
                inputs_embeds=hidden,
                attention_mask=attention_mask,
                past_key_values=None,
                position_ids=position_ids,
            )
        else:
            mask = create_bidirectional_mask(config=self.config, inputs_embeds=hidden, attention_mask=attention_mask)
        extra = {} if self.rotary is None else {"position_embeddings": self.rotary(hidden, position_ids=position_ids)}
        out = self.block(hidden, attention_mask=mask, position_ids=position_ids, use_cache=False, **extra)
        return _with_mask(out[0] if isinstance(out, tuple) else out, attention_mask)


class Head(nn.Module):
    """The last layer: final norm (if any) and the head (logits)."""

    def __init__(self, norm: nn.Module | None, lm_head: nn.Module) -> None:
        super().__init__()
        self.norm, self.lm_head = norm, lm_head

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.lm_head(hidden if self.norm is None else self.norm(hidden))


def _config_of(config: Any) -> Any:
    if isinstance(config, Mapping):
        from transformers import AutoConfig

        values = dict(config)
        return AutoConfig.for_model(values.pop("model_type"), **values)
    return config


class HFCausalLM(PipelineLanguageModel):
    """A ``transformers`` causal LM (from a config, a config dict with ``model_type``, or a factory) as a pipeline.

    Args:
        config: a ``transformers`` config, a dict with ``model_type`` (built with ``AutoConfig.for_model``), or a
            factory returning the model.
        shift_labels: the labels are the inputs shifted by one inside the loss (a causal LM's convention); False:
            ``labels`` are already aligned with the outputs.
        **optim: the optimizer and its schedule, ``PipelineLanguageModel``'s: ``optimizer`` (``"adamw"``, ``"sgd"``
            or ``"muon"``: Muon for the blocks' matrices, AdamW for the rest), ``lr``, ``weight_decay``, ``betas``,
            ``momentum`` (SGD), ``warmup_steps`` and ``max_steps`` (linear warm-up, cosine decay to
            ``min_lr_ratio`` x ``lr``).
    """

    auto_model = "AutoModelForCausalLM"  # the transformers class that builds the model from its config

    def __init__(self, config: Any | Callable[[], nn.Module], shift_labels: bool = True, **optim: Any) -> None:
        super().__init__(_config_of(config), **optim)
        self.shift_labels = shift_labels

    def build_model(self) -> nn.Module:
        """The Hugging Face model (on the meta device under ``strategy="pd2bw"``)."""
        if callable(self.config) and not hasattr(self.config, "to_dict"):
            return self.config()
        import transformers

        return getattr(transformers, self.auto_model).from_config(self.config)

    def save_pretrained(self, directory: str, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Write the model in Hugging Face's own format (config + safetensors), which ``AutoModelFor*.from_pretrained``
        loads. ``state_dict``: this module's weights by its names, e.g. ``lightning_pd2bw.checkpoint.consolidate(ckpt)``
        of a pipelined run, loaded into a freshly built module; default: the module's current weights."""
        self.configure_model()
        if state_dict is not None:
            self.load_state_dict(state_dict)
        self.hf_model.save_pretrained(directory)

    def build_layers(self) -> list[nn.Module]:
        model = self.build_model()
        family = FAMILIES.get(getattr(model.config, "model_type", ""))
        if family is None:
            raise ValueError(
                f"HFCausalLM: model_type {getattr(model.config, 'model_type', None)!r} is not a supported family "
                f"(supported: {', '.join(FAMILIES)}). Add a Family entry to lightning_pd2bw.models.hf.FAMILIES "
                "naming its base model, embeddings, blocks, final norm and rotary embedding"
            )
        self.__dict__["hf_model"] = model  # the layers hold its modules; not registered twice
        base = _part(model, family.base)
        embeddings = Embeddings(_part(base, family.tokens), _part(base, family.positions), _part(base, family.dropout))
        blocks = [
            DecoderBlock(block, model.config, _part(base, family.rotary), family.causal)
            for block in _part(base, family.blocks)
        ]
        head = _part(model, family.head) if family.head else model.get_output_embeddings()
        return [embeddings, *blocks, Head(_part(base, family.norm), head)]

    def configure_model(self) -> None:
        if self.layers is None:
            self.layers = nn.ModuleList(self.build_layers())  # a model built off the meta device is initialised

    @torch.no_grad()
    def init_pipeline_layer(self, index: int) -> None:
        """The model's own ``_init_weights`` on every module of layer ``index``, children first (as
        ``PreTrainedModel.initialize_weights`` applies it)."""
        from ..engine.materialize import post_order

        for module in post_order(self.layers[index]):
            self.hf_model._init_weights(module)

    def pipeline_inputs(self, batch: dict[str, torch.Tensor]) -> Any:
        mask = batch.get("attention_mask")
        return batch["input_ids"] if mask is None else (batch["input_ids"], mask)

    def pipeline_loss(self, logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        labels = batch.get("labels", batch["input_ids"])
        if self.shift_labels:
            logits, labels = logits[:, :-1], labels[:, 1:]
        return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        self.configure_model()
        value: Any = self.pipeline_inputs({"input_ids": input_ids, "attention_mask": attention_mask})
        for layer in self.layers:
            value = layer(*value) if isinstance(value, tuple) else layer(value)
        return value

    def block_layers(self) -> list[nn.Module]:
        return [layer for layer in self.layers if isinstance(layer, DecoderBlock)]

    def default_sparsity_targets(self) -> list[str]:
        """The blocks' matrices (Linear or GPT-2's Conv1D weights)."""
        self.configure_model()
        return [
            f"layers.{i}.{name}"
            for i, layer in enumerate(self.layers)
            if isinstance(layer, DecoderBlock)
            for name, p in layer.named_parameters()
            if p.dim() == 2
        ]

    def flops_per_token(self) -> float:
        """6 x the matrices a token meets (blocks and the LM head) + attention, 12 x layers x context x width."""
        self.configure_model()
        c = self.hf_model.config
        blocks = self.block_layers()
        matrices = sum(p.numel() for b in blocks for p in b.parameters() if p.dim() == 2)
        head = self.hf_model.get_output_embeddings().weight.numel()
        context = getattr(c, "n_positions", None) or getattr(c, "max_position_embeddings", 2048)
        return 6.0 * (matrices + head) + 12.0 * len(blocks) * context * c.hidden_size


class HFMaskedLM(HFCausalLM):
    """A ``transformers`` masked LM (BERT) as a pipeline: embeddings, encoder blocks (bidirectional attention;
    a padding ``attention_mask`` travels along), the MLM head; the loss is cross-entropy against ``labels``
    (-100 where nothing is predicted), unshifted. Batches: ``{"input_ids", "labels", optional "attention_mask"}``.

    Args:
        config: a ``transformers`` config, a dict with ``model_type``, or a factory returning the model.
        **optim: the optimizer and its schedule, ``PipelineLanguageModel``'s: ``optimizer`` (``"adamw"``, ``"sgd"``
            or ``"muon"``: Muon for the blocks' matrices, AdamW for the rest), ``lr``, ``weight_decay``, ``betas``,
            ``momentum`` (SGD), ``warmup_steps`` and ``max_steps`` (linear warm-up, cosine decay to
            ``min_lr_ratio`` x ``lr``).
    """

    auto_model = "AutoModelForMaskedLM"

    def __init__(self, config: Any | Callable[[], nn.Module], **optim: Any) -> None:
        super().__init__(config, shift_labels=False, **optim)
