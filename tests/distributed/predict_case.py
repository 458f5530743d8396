"""The model and prompts of the prediction test, and the plain module's greedy generation."""

from __future__ import annotations

import torch

from lightning_pd2bw.models import GPT, GPTConfig

NEW_TOKENS = 3


def model() -> GPT:
    """Seeded per-layer init: the same weights on any layout, built whole or stage by stage."""
    return GPT(GPTConfig(n_layer=3, n_head=2, n_embd=16, block_size=16, seed=5))


def prompts() -> torch.Tensor:
    return torch.randint(0, 256, (8, 5), generator=torch.Generator().manual_seed(3))


@torch.no_grad()
def generate_plain() -> tuple[torch.Tensor, torch.Tensor]:
    gpt = model()
    gpt.configure_model()
    tokens, logits = prompts(), []
    for _ in range(NEW_TOKENS):
        last = gpt(tokens)[:, -1]
        logits.append(last)
        tokens = torch.cat([tokens, last.argmax(-1, keepdim=True)], dim=1)
    return tokens, torch.stack(logits)
