"""Jin et al.'s (ICLR 2025) fair comparator for a sparse GPT: the dense GPT of equal average non-embedding
parameters, and the training FLOPs of a GPT at another width. Used by ``benchmarks/transfer.py`` (per sparse
pre-training) and ``benchmarks/convergence.py`` (the ``+widthN`` setting suffix, whose FLOPs it counts)."""

from __future__ import annotations

from pathlib import Path

import yaml

from lightning_pd2bw.models import GPT, GPTConfig

PRESET = {"gpt_tiny": "tiny", "gpt_small": "small"}  # conf/model's GPTConfig preset


def non_embedding(config: GPTConfig, density: float = 1.0) -> float:
    """Non-embedding parameters of a GPT whose block matrices (what the sparsity callbacks target) are at
    ``density``: per block 12 c^2 matrix weights and 13 c biases and norm weights, plus the final norm."""
    c = config.n_embd
    return config.n_layer * (12 * c * c * density + 13 * c) + 2 * c


def equal_params_width(model: str, density: float) -> int:
    """The width (a multiple of the heads, depth kept) of the dense GPT whose non-embedding parameters are nearest
    the sparse one's average (Jin et al.'s comparator)."""
    base = GPTConfig.from_name(PRESET[model])
    target = non_embedding(base, density)
    widths = range(base.n_head, base.n_embd + 1, base.n_head)
    return min(widths, key=lambda c: abs(non_embedding(GPTConfig.from_name(PRESET[model], n_embd=c)) - target))


def dense_flops(model: str, width: int) -> float:
    """Training FLOPs per token of the dense GPT at ``width`` over the preset's."""
    flops = (GPT(GPTConfig.from_name(PRESET[model], n_embd=c)).flops_per_token() for c in (width, None))
    return next(flops) / next(flops)


def width_flops(folder: Path, model: str) -> float:
    """A run's FLOPs per token over its preset's from the width its resolved config sets (1.0 at the preset's)."""
    config = yaml.safe_load((folder / "config.yaml").read_text())
    width = config["model"].get("config", {}).get("n_embd")
    return dense_flops(model, int(width)) if width else 1.0
