"""Per-layer profiles at one microbatch size: time, activation bytes, boundary bytes, parameters.

Two sources give the same record: ``measure.py`` times each layer on the real device, and
``analytic_profile`` computes it for a transformer from FLOPs and bytes on a described device (for
clusters the user is not on). Layer order is the pipeline's: embedding, blocks, head.
"""

from __future__ import annotations

import math
from collections.abc import Callable
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
    # of ``backward_s``, the linear maps' weight gradients and their accumulation: what a split backward (``zb_h1``)
    # defers to W (``engine/weight_grads.py``); 0 where nothing is deferred (a layer on the 2:4 kernels, a lookup)
    weight_grad_s: float = 0.0


def block_activation_bytes(seq: int, micro: int, hidden: int, heads: int, activation_bytes: int) -> float:
    """Korthikanti et al. 2022: ``s*b*h*(34 + 5*a*s/h)`` bytes per block with 16-bit activations."""
    return seq * micro * hidden * (34 + 5 * heads * seq / hidden) * activation_bytes / 2


# The output tile of a large 16-bit GEMM in cuBLAS/CUTLASS on Ampere and Hopper (rows x columns of the output): a
# GEMM runs ceil(rows/128) x ceil(cols/256) tiles in waves of one tile per multiprocessor (NVIDIA's "Matrix
# Multiplication Background" guide, wave quantization).
TILE = (128, 256)


def block_linears(hidden: int) -> tuple[tuple[int, int], ...]:
    """(fan_in, fan_out) of a GPT block's matrices: Q/K/V fused, the attention's output, the MLP's two."""
    return ((hidden, 3 * hidden), (hidden, hidden), (hidden, 4 * hidden), (4 * hidden, hidden))


def wave_efficiency(rows: int, cols: int, device: DeviceSpec) -> float:
    """The fraction of the multiprocessors' waves a GEMM with a ``rows x cols`` output keeps busy (1.0 when the
    device does not say how many it has)."""
    if not device.multiprocessors:
        return 1.0
    tiles = math.ceil(rows / TILE[0]) * math.ceil(cols / TILE[1])
    return tiles / (math.ceil(tiles / device.multiprocessors) * device.multiprocessors)


def gemm_seconds(rows: int, cols: int, reduction: int, element_bytes: int, device: DeviceSpec) -> float:
    """A roofline: the GEMM's FLOPs at the tensor cores' achieved rate (its last wave counted), or its operands' and
    output's bytes at the memory's, whichever is longer."""
    compute = (
        2 * rows * cols * reduction / (device.peak_flops * device.efficiency * wave_efficiency(rows, cols, device))
    )
    traffic = (rows * reduction + reduction * cols + rows * cols) * element_bytes
    return max(compute, memory_seconds(traffic, device))


def memory_seconds(num_bytes: float, device: DeviceSpec) -> float:
    """Streaming ``num_bytes`` through the device's memory at its achieved bandwidth."""
    return num_bytes / (device.memory_bandwidth * device.memory_efficiency)


def linear_seconds(
    tokens: int, fan_in: int, fan_out: int, element_bytes: int, device: DeviceSpec, speedup: float = 1.0
) -> tuple[float, float]:
    """(forward, backward) of a linear layer over ``tokens`` rows: the backward is the input's gradient (tokens x
    fan_in) and the weight's (fan_in x fan_out), each with its own shape's waves. ``speedup``: the 2:4 kernels'
    measured factor on the forward and the input-gradient GEMMs (``semi_sparse_speedup.py``; the weight's stays dense)."""
    forward = gemm_seconds(tokens, fan_out, fan_in, element_bytes, device) / speedup
    backward = gemm_seconds(tokens, fan_in, fan_out, element_bytes, device) / speedup
    return forward, backward + gemm_seconds(fan_in, fan_out, tokens, element_bytes, device)


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
    sparse_speedup: Callable[[int, int, int], float] | None = None,
) -> list[LayerProfile]:
    """Embedding, ``num_blocks`` pre-norm transformer blocks and the LM head, from FLOPs and bytes.

    Each GEMM is timed by a roofline with its last wave counted (``gemm_seconds``), so the micro size and the device
    both enter: a small microbatch leaves more of the last wave idle. Memory-bound work is bytes at the achieved
    bandwidth: the embedding lookup, the blocks' elementwise passes, the cross-entropy, the optimizer step and, every
    microbatch, the backward adding each parameter's new gradient into its float32 (the parameters' dtype)
    accumulator (read both, write one). ``sparse_speedup`` (tokens, fan_in, fan_out) -> factor: the blocks' matrices
    on the 2:4 kernels (``sparsity.kernels=true``), at their measured factor per shape.
    """
    bytes_of = Precision.of(precision)
    weight_bytes, act_bytes = bytes_of.parameter_bytes, bytes_of.activation_bytes
    tokens = seq * micro
    boundary = tokens * hidden * act_bytes

    def optimizer_time(params: int) -> float:
        # read param, grad and states, write param and states
        return memory_seconds(params * weight_bytes * (3 + 2 * optimizer_states), device)

    def accumulation(params: int) -> float:  # each microbatch's gradient added into the accumulator
        return memory_seconds(params * (act_bytes + 2 * weight_bytes), device)

    embed_params = embedding_parameters if embedding_parameters is not None else (vocab + seq) * hidden
    embed_time = memory_seconds(3 * boundary, device)
    embedding = LayerProfile(
        embed_time,
        2 * embed_time + accumulation(embed_params),
        tokens * 8,
        boundary,
        embed_params,
        optimizer_time(embed_params),
    )
    block_params = 12 * hidden * hidden + 13 * hidden
    factor = sparse_speedup or (lambda *_: 1.0)
    linears = [linear_seconds(tokens, i, o, act_bytes, device, factor(tokens, i, o)) for i, o in block_linears(hidden)]
    attention = 4 * micro * seq * seq * hidden / (device.peak_flops * device.efficiency)
    elementwise = memory_seconds(device.elementwise_passes * boundary, device)
    # the weights' gradient GEMMs (fan_in x fan_out over the tokens), deferred by a split unless on the 2:4 kernels
    deferred = (
        0.0 if sparse_speedup else sum(gemm_seconds(i, o, tokens, act_bytes, device) for i, o in block_linears(hidden))
    )
    block = LayerProfile(
        sum(f for f, _ in linears) + attention + elementwise / 3,
        sum(b for _, b in linears) + 2 * attention + 2 * elementwise / 3 + accumulation(block_params),
        block_activation_bytes(seq, micro, hidden, heads, act_bytes),
        boundary,
        block_params,
        optimizer_time(block_params),
        weight_grad_s=deferred + (0.0 if sparse_speedup else accumulation(block_params)),
    )
    head_params = head_parameters if head_parameters is not None else vocab * hidden + 2 * hidden
    logits_forward, logits_backward = linear_seconds(tokens, hidden, vocab, act_bytes, device)
    loss = memory_seconds(tokens * vocab * (act_bytes + 4), device)  # the logits read, float32 log-softmax written
    head = LayerProfile(
        logits_forward + loss,
        logits_backward + 2 * loss + accumulation(head_params),
        2 * boundary + tokens * vocab * (act_bytes + 4),  # norm and matmul inputs, logits and fp32 log-softmax
        0.0,
        head_params,
        optimizer_time(head_params),
        weight_grad_s=gemm_seconds(hidden, vocab, tokens, act_bytes, device) + accumulation(head_params),
    )
    return [embedding, *[block] * num_blocks, head]


def one_stage_step(layers: list[LayerProfile], microbatches: int) -> float:
    """A one-stage pipeline's step from a profile: every layer's forward and backward per microbatch, one optimizer
    step (what ``benchmarks/gpu_stage.py`` measures on one GPU)."""
    return microbatches * sum(x.forward_s + x.backward_s for x in layers) + sum(x.optimizer_s for x in layers)
