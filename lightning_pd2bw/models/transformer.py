"""Transformer pieces shared by GPT and BERT, each a pipeline layer with a seeded ``reset_parameters``.

Every layer initialises itself from a ``torch.Generator`` (values drawn on the CPU, copied to the
parameter's device), so a layer materialised alone on its pipeline stage gets exactly the values it
would get inside the whole model on one device.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

INIT_STD = 0.02  # GPT-2 / BERT initialisation


def normal_(param: torch.Tensor, std: float, generator: torch.Generator) -> None:
    with torch.no_grad():
        param.copy_(torch.randn(param.shape, generator=generator, device=generator.device) * std)


def ones_zeros_(norm: nn.LayerNorm) -> None:
    with torch.no_grad():
        norm.weight.fill_(1.0)
        norm.bias.fill_(0.0)


def zero_(param: torch.Tensor) -> None:
    with torch.no_grad():
        param.zero_()


class SelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, causal: bool) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}")
        self.n_head = n_head
        self.causal = causal
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, channels = x.shape
        q, k, v = self.qkv(x).split(channels, dim=2)
        shape = (batch, seq, self.n_head, channels // self.n_head)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.proj(y.transpose(1, 2).contiguous().view(batch, seq, channels))


class Block(nn.Module):
    """Pre-norm transformer block (GPT-2 style); BERT uses it unmasked."""

    def __init__(self, n_embd: int, n_head: int, causal: bool, n_layer: int, gelu: str = "exact") -> None:
        super().__init__()
        self.n_layer = n_layer
        self.approximate = "tanh" if gelu == "tanh" else "none"  # F.gelu's: GPT-2's checkpoints use the tanh one
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = SelfAttention(n_embd, n_head, causal)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.fc_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x)), approximate=self.approximate))

    def reset_parameters(self, generator: torch.Generator) -> None:
        # residual projections scaled by 1/sqrt(2 * n_layer) (GPT-2 paper)
        residual_std = INIT_STD / math.sqrt(2 * self.n_layer)
        for linear, std in (
            (self.attn.qkv, INIT_STD),
            (self.attn.proj, residual_std),
            (self.fc, INIT_STD),
            (self.fc_proj, residual_std),
        ):
            normal_(linear.weight, std, generator)
            zero_(linear.bias)
        ones_zeros_(self.ln_1)
        ones_zeros_(self.ln_2)


class TokenEmbedding(nn.Module):
    """Token + learned position embedding; BERT adds a LayerNorm."""

    def __init__(self, vocab_size: int, block_size: int, n_embd: int, norm: bool) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.ln = nn.LayerNorm(n_embd) if norm else None
        self.block_size = block_size

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        seq = idx.shape[1]
        if seq > self.block_size:
            raise ValueError(f"sequence length {seq} exceeds the model's block_size={self.block_size}")
        x = self.wte(idx) + self.wpe(torch.arange(seq, device=idx.device))
        return self.ln(x) if self.ln is not None else x

    def reset_parameters(self, generator: torch.Generator) -> None:
        normal_(self.wte.weight, INIT_STD, generator)
        normal_(self.wpe.weight, INIT_STD, generator)
        if self.ln is not None:
            ones_zeros_(self.ln)
