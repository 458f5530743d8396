"""A first-order memory estimate per pipeline stage (weights, gradients, optimizer state, stash).

Activation bytes per transformer block and microbatch follow Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models"): ``s*b*h*(34 + 5*a*s/h)`` bytes with 16-bit
activations, scaled here to the activation dtype. A stage stashes ``d - r`` microbatches (1F1B and
2BW); with recomputation it stashes only each microbatch's stage input and rebuilds one
microbatch's activations at a time. The planner (cost model) refines this with measured profiles.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1024**3


@dataclass(frozen=True)
class StageMemory:
    weights: float
    gradients: float
    optimizer: float
    activations: float

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations


def block_activation_bytes(seq: int, micro: int, hidden: int, heads: int, activation_bytes: int) -> float:
    return seq * micro * hidden * (34 + 5 * heads * seq / hidden) * activation_bytes / 2


def estimate_stage(
    params: int,
    blocks: int,
    stage: int,
    num_stages: int,
    num_microbatches: int,
    *,
    seq: int,
    micro: int,
    hidden: int,
    heads: int,
    vocab: int,
    has_head: bool,
    mode: str = "2bw",
    recompute: bool = False,
    precision: str = "32-true",
    optimizer: str = "adamw",
) -> StageMemory:
    weight_bytes = 2 if precision.startswith(("bf16-true", "16-true")) else 4
    act_bytes = 4 if precision == "32-true" else 2
    versions = 2 if mode == "2bw" else 1
    states = {"adamw": 2, "sgd": 1}.get(optimizer, 2)
    stash = num_microbatches if mode == "gpipe" else num_stages - stage  # GPipe keeps every microbatch
    per_micro = blocks * block_activation_bytes(seq, micro, hidden, heads, act_bytes)
    if has_head:
        per_micro += seq * micro * vocab * (act_bytes + 4)  # logits and their fp32 copy for the loss
    if recompute:
        stage_input = seq * micro * hidden * act_bytes
        activations = stash * stage_input + per_micro
    else:
        activations = stash * per_micro
    return StageMemory(
        weights=versions * params * weight_bytes,
        gradients=params * weight_bytes,
        optimizer=states * params * weight_bytes,
        activations=activations,
    )
