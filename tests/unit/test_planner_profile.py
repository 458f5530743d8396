"""The planner's layer profiles: the analytic counts by hand, the measured profile against real bytes, the
profiling microbatch on the device, and bfloat16 weight versions profiled as the pipeline runs them."""

from __future__ import annotations

import pytest
import torch

from lightning_pd2bw.planner import DeviceSpec
from lightning_pd2bw.planner.hardware import GiB
from lightning_pd2bw.planner.measure import measure_layers
from lightning_pd2bw.planner.profile import analytic_profile, block_activation_bytes


def test_analytic_profile_flops_and_activations():
    """A device without waves or memory losses: every GEMM at peak (compute-bound at these shapes), the elementwise
    passes and the float32 accumulation at the bandwidth, by hand."""
    device = DeviceSpec(
        "unit", peak_flops=1e12, memory_bytes=GiB, memory_bandwidth=1e12, efficiency=1.0, elementwise_passes=100
    )
    layers = analytic_profile(
        num_blocks=2, hidden=64, heads=4, vocab=256, seq=32, micro=2, device=device, precision="32-true"
    )
    block = layers[1]
    gemms = 2 * 64 * 12 * 64 * 64 / 1e12  # 2 x tokens x 12 h^2, at peak
    attention = 4 * 2 * 32 * 32 * 64 / 1e12  # 4 b s^2 h
    elementwise = 100 * 64 * 64 * 4 / 1e12  # 100 activation-sized passes of tokens x h float32 elements
    accumulate = (
        (12 * 64 * 64 + 13 * 64) * (4 + 2 * 4) / 1e12
    )  # the new gradient read, the accumulator read and written
    assert block.forward_s == pytest.approx(gemms + attention + elementwise / 3)
    assert block.backward_s == pytest.approx(2 * gemms + 2 * attention + 2 * elementwise / 3 + accumulate)
    assert block.activation_bytes == block_activation_bytes(32, 2, 64, 4, 4)
    assert block.parameters == 12 * 64 * 64 + 13 * 64 and len(layers) == 4


def test_measured_profile_counts_real_bytes():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(32, 64), torch.nn.Linear(64, 8)]
    x = torch.randn(4, 32)
    before = layers[0].weight.detach().clone()
    profiles = measure_layers(layers, x, torch.device("cpu"), loss_fn=lambda out: out.square().mean(), repeats=2)
    assert profiles[0].parameters == 32 * 64 + 64 and profiles[1].parameters == 64 * 8 + 8
    assert profiles[0].output_bytes == 4 * 64 * 4 and profiles[1].output_bytes == 0
    assert profiles[0].activation_bytes == 4 * 32 * 4, "a Linear saves its input"
    assert all(p.forward_s > 0 and p.backward_s >= 0 for p in profiles)
    assert all(p.weight_grad_s > 0 for p in profiles), "zb_h1's W timed: each layer is a linear map"
    embedding = measure_layers([torch.nn.Embedding(16, 8)], torch.zeros(4, dtype=torch.long), torch.device("cpu"))
    assert embedding[0].weight_grad_s < 1e-4, "a lookup defers nothing (its gradient is computed in B)"
    assert torch.equal(layers[0].weight, before) and layers[0].weight.grad is None, "profiling leaves the model alone"


def test_profiling_microbatch_has_inputs_and_targets_on_the_device():
    """plan="auto" on a GPU moved only the inputs; the loss then met CPU labels (a device mismatch)."""
    from lightning_pd2bw.planner.auto import sample_microbatch

    batch = {"input_ids": torch.zeros(4, 8, dtype=torch.long), "labels": torch.ones(4, 8, dtype=torch.long), "n": 3}
    micro = sample_microbatch(batch, 2, torch.device("meta"))
    assert micro["input_ids"].is_meta and micro["labels"].is_meta and micro["n"] == 3
    assert micro["labels"].shape == (2, 8)


def test_the_profile_of_bfloat16_weight_versions_keeps_no_cast_of_the_weights():
    """``plan="auto"`` under bf16-mixed with ``weight_dtype``: the layers are profiled on bfloat16 weights, as the
    pipeline runs them, so the activations a microbatch keeps for its backward hold no bfloat16 cast of the weights
    (autocast keeps one per float32 weight: 2 bytes per parameter of each matmul); the optimizer steps float32."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, 96), torch.nn.Linear(96, 32)]
    x = torch.randn(4, 64)

    def profile(weight_dtype):
        autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)  # noqa: E731
        return measure_layers(
            layers, x, torch.device("cpu"), repeats=1, autocast=autocast, weight_dtype=weight_dtype,
            loss_fn=lambda out: out.float().square().mean(),
        )  # fmt: skip

    casts, versions = profile(None), profile(torch.bfloat16)
    for layer, cast, version in zip(layers, casts, versions):
        assert cast.activation_bytes - version.activation_bytes == layer.weight.numel() * 2
        assert cast.parameters == version.parameters == sum(p.numel() for p in layer.parameters())
    assert all(p.dtype == torch.float32 for layer in layers for p in layer.parameters()), "the model is untouched"
