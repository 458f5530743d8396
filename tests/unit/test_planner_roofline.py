"""The planner's roofline (issue 77 item 4): each GEMM's time from its shape on the device (its last wave counted),
memory passes at the achieved bandwidth, so the micro size and the device enter the plan. Checked against the one
GPU measurement it is calibrated on and against the rule written out by hand."""

from __future__ import annotations

import pytest

from lightning_pd2bw.planner.hardware import DEVICES, DeviceSpec, GiB
from lightning_pd2bw.planner.profile import TILE, analytic_profile, gemm_seconds, one_stage_step, wave_efficiency

GPT13B = {"hidden": 5120, "heads": 40, "vocab": 50304, "seq": 2048}  # conf/model/gpt13b.yaml's shapes


def slice_step(device: DeviceSpec, micro: int, microbatches: int, blocks: int = 5) -> float:
    """One step of a one-stage pipeline: the layers' forward and backward per microbatch, one optimizer step."""
    return one_stage_step(analytic_profile(num_blocks=blocks, micro=micro, device=device, **GPT13B), microbatches)


def test_the_roofline_reproduces_the_h200_step_it_is_calibrated_on():
    """docs/gpus-log.md, 2026-11-27: the 13B stage slice (embedding, 5 blocks, head; 8 microbatches of 1) trained
    under Flush in 0.400 s a step on one H200. The planner's device fractions are set from it: within 2%."""
    assert slice_step(DEVICES["h200_141g"], micro=1, microbatches=8) == pytest.approx(0.400, rel=0.02)


def test_an_h100_plans_slower_than_an_h200_and_micro_2_faster_than_micro_1():
    """The H100's memory streams at 3.35 TB/s against the H200's 4.8 (the same tensor cores): the memory-bound part of
    the step (elementwise passes, the float32 accumulation, the optimizer) is longer. A microbatch of 2 sequences
    fills more of each GEMM's last wave and pays the accumulation once for twice the tokens."""
    h100, h200 = DEVICES["h100_80g"], DEVICES["h200_141g"]
    assert h100.peak_flops == h200.peak_flops and h100.memory_bandwidth < h200.memory_bandwidth
    for micro, m in ((1, 8), (2, 4)):  # 8 sequences a step either way
        assert slice_step(h100, micro, m) > 1.05 * slice_step(h200, micro, m)
    for device in (h100, h200):
        assert slice_step(device, 2, 4) < 0.95 * slice_step(device, 1, 8)


def test_waves_by_hand():
    """A 2048 x 5120 output is 16 x 20 = 320 tiles of 128 x 256: three waves of 132 multiprocessors, 320 of 396 slots
    busy; 4096 x 5120 is 640 tiles, five waves, 640 of 660."""
    h100 = DEVICES["h100_80g"]
    assert TILE == (128, 256) and h100.multiprocessors == 132
    assert wave_efficiency(2048, 5120, h100) == pytest.approx(320 / 396)
    assert wave_efficiency(4096, 5120, h100) == pytest.approx(640 / 660)
    assert wave_efficiency(2048, 5120, DeviceSpec("unit", 1e12, GiB, 1e12)) == 1.0  # not modelled without a count
    flops = 2 * 2048 * 5120 * 5120
    assert gemm_seconds(2048, 5120, 5120, 2, h100) == pytest.approx(
        flops / (h100.peak_flops * h100.efficiency * 320 / 396)
    )


def test_a_skinny_gemm_is_bound_by_its_bytes():
    """One row against a 5120 x 5120 weight: 52 MFLOPs, but the weight's 50 MiB must stream in."""
    h100 = DEVICES["h100_80g"]
    weight = (1 * 5120 + 5120 * 5120 + 1 * 5120) * 2
    assert gemm_seconds(1, 5120, 5120, 2, h100) == pytest.approx(
        weight / (h100.memory_bandwidth * h100.memory_efficiency)
    )
    compute = 2 * 5120 * 5120 / (h100.peak_flops * h100.efficiency * wave_efficiency(1, 5120, h100))
    assert compute < gemm_seconds(1, 5120, 5120, 2, h100) / 10


def test_no_gemm_is_credited_more_than_a_full_wave_reaches():
    """Issue 95: the wave model only takes away (its last wave's idle share); no shape of the 13B block (forward, input
    and weight gradients at micro 1 to 4), nor 8192^3, is planned above the device's full-wave rate, which on the
    H100 and H200 stays below the ~790-800 TFLOP/s a large bf16 GEMM measures there (the anchors' figure)."""
    from lightning_pd2bw.planner.profile import block_linears

    for name in ("h100_80g", "h200_141g"):
        device = DEVICES[name]
        ceiling = device.peak_flops * device.efficiency
        assert ceiling <= 800e12
        shapes = [(8192, 8192, 8192)]
        for tokens in (2048, 4096, 8192):
            for fan_in, fan_out in block_linears(5120):
                shapes += [(tokens, fan_out, fan_in), (tokens, fan_in, fan_out), (fan_in, fan_out, tokens)]
        for rows, cols, reduction in shapes:
            rate = 2 * rows * cols * reduction / gemm_seconds(rows, cols, reduction, 2, device)
            assert rate <= ceiling * (1 + 1e-12), (name, rows, cols, reduction, rate / 1e12)
