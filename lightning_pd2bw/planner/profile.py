"""Per-layer profiles at one microbatch size: time, activation bytes, boundary bytes, parameters.

Two sources give the same record: ``measure.py`` times each layer on the real device, and
``analytic_profile`` computes it for a transformer from FLOPs and bytes on a described device (for
clusters the user is not on). Layer order is the pipeline's: embedding, blocks, head.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..engine.precision import Precision
from .hardware import DeviceSpec


@dataclass(frozen=True)
class LayerProfile:
    forward_s: float  # one microbatch
    backward_s: float  # one microbatch, input and weight gradients
    activation_bytes: float  # kept for the backward of one microbatch (what a stash holds)
    output_bytes: float  # sent to the next stage per microbatch (the gradient coming back is as large)
    parameters: int
    optimizer_s: float = 0.0  # one optimizer step over this layer's parameters
    # the output as the stage keeps it for its backward, in its own dtype (None: ``output_bytes`` x the profile's
    # ``output_factor``); e.g. float32 under bf16-mixed while bfloat16 crosses (``boundary_dtype``)
    kept_output_bytes: float | None = None


def block_activation_bytes(seq: int, micro: int, hidden: int, heads: int, activation_bytes: int) -> float:
    """Korthikanti et al. 2022: ``s*b*h*(34 + 5*a*s/h)`` bytes per block with 16-bit activations."""
    return seq * micro * hidden * (34 + 5 * heads * seq / hidden) * activation_bytes / 2


def analytic_profile(
    *,
    num_blocks: int,
    hidden: int,
    heads: int,
    vocab: int,
    seq: int,
    micro: int,
    device: DeviceSpec,
    precision: str = "bf16-mixed",
    embedding_parameters: int | None = None,
    head_parameters: int | None = None,
    optimizer_states: int = 2,
) -> list[LayerProfile]:
    """Embedding, ``num_blocks`` pre-norm transformer blocks and the LM head, from FLOPs and bytes.

    Matmul time is FLOPs / (peak x efficiency); the backward is twice the forward. Memory-bound work
    (embedding lookup, optimizer step) is bytes / memory bandwidth.
    """
    bytes_of = Precision.of(precision)
    weight_bytes, act_bytes = bytes_of.parameter_bytes, bytes_of.activation_bytes
    tokens = seq * micro
    flop_rate = device.peak_flops * device.efficiency
    boundary = tokens * hidden * act_bytes

    def optimizer_time(params: int) -> float:
        # read param, grad and states, write param and states
        return params * weight_bytes * (3 + 2 * optimizer_states) / device.memory_bandwidth

    embed_params = embedding_parameters if embedding_parameters is not None else (vocab + seq) * hidden
    embed_time = 3 * boundary / device.memory_bandwidth
    embedding = LayerProfile(
        embed_time, 2 * embed_time, tokens * 8, boundary, embed_params, optimizer_time(embed_params)
    )
    block_params = 12 * hidden * hidden + 13 * hidden
    block_flops = 2 * tokens * 12 * hidden * hidden + 4 * micro * seq * seq * hidden
    block = LayerProfile(
        block_flops / flop_rate,
        2 * block_flops / flop_rate,
        block_activation_bytes(seq, micro, hidden, heads, act_bytes),
        boundary,
        block_params,
        optimizer_time(block_params),
    )
    head_flops = 2 * tokens * hidden * vocab
    head_params = head_parameters if head_parameters is not None else vocab * hidden + 2 * hidden
    head = LayerProfile(
        head_flops / flop_rate,
        2 * head_flops / flop_rate,
        2 * boundary + tokens * vocab * (act_bytes + 4),  # norm and matmul inputs, logits and fp32 log-softmax
        0.0,
        head_params,
        optimizer_time(head_params),
    )
    return [embedding, *[block] * num_blocks, head]
