"""The planner's time for the 2:4 kernels (``planner/semi_sparse_speedup.py``): the measured factor divides each
block matrix's forward and input-gradient GEMMs, never its weight gradient, and a shape not measured plans at 1.0."""

from __future__ import annotations

import json

import pytest

from lightning_pd2bw.planner.hardware import DEVICES
from lightning_pd2bw.planner.profile import analytic_profile, block_linears, gemm_seconds
from lightning_pd2bw.planner.semi_sparse_speedup import TABLE, shape_key, speedup_for

SHAPE = dict(num_blocks=2, hidden=1024, heads=8, vocab=4096, seq=512, micro=2)


def test_a_measured_factor_divides_the_forward_and_input_gradient_gemms_only():
    device = DEVICES["h100_80g"]
    dense = analytic_profile(**SHAPE, device=device)
    sparse = analytic_profile(**SHAPE, device=device, sparse_speedup=lambda tokens, fan_in, fan_out: 2.0)
    tokens, element = SHAPE["seq"] * SHAPE["micro"], 2
    forward = sum(gemm_seconds(tokens, o, i, element, device) for i, o in block_linears(SHAPE["hidden"]))
    input_grad = sum(gemm_seconds(tokens, i, o, element, device) for i, o in block_linears(SHAPE["hidden"]))
    block, sparse_block = dense[1], sparse[1]
    assert block.forward_s - sparse_block.forward_s == pytest.approx(forward / 2)
    assert block.backward_s - sparse_block.backward_s == pytest.approx(input_grad / 2)
    assert (dense[0], dense[-1]) == (sparse[0], sparse[-1])  # the embedding and the head stay dense


def test_factors_come_from_the_benchmarks_table_by_device_and_shape_and_default_to_one(tmp_path):
    table = tmp_path / "speedup.json"
    table.write_text(json.dumps({"h100_80g": {"speedup": {shape_key(2048, 5120, 20480): 1.27}}}))
    factor = speedup_for("h100_80g", table)
    assert factor(2048, 5120, 20480) == 1.27
    assert factor(4096, 5120, 20480) == 1.0  # another shape: not extrapolated
    assert speedup_for("a100_80g", table)(2048, 5120, 20480) == 1.0  # another device
    assert speedup_for("h100_80g", tmp_path / "missing.json")(2048, 5120, 20480) == 1.0
    assert isinstance(json.loads(TABLE.read_text()), dict)  # the shipped table parses (empty until measured on a GPU)


def test_the_dry_run_says_whether_the_kernels_run_and_how_many_shapes_are_measured():
    from omegaconf import OmegaConf

    from lightning_pd2bw.cli.run_plan import _semi_structured_time

    def line(**sparsity) -> str:
        cfg = OmegaConf.create(
            {
                "cluster": {"device": "v100_16g"},
                "trainer": {"precision": "bf16-mixed"},
                "sparsity": {"n": 2, "m": 4, **sparsity},
            }
        )
        return _semi_structured_time(cfg, cfg.sparsity)

    assert "saved only with sparsity.kernels=true" in line()
    assert "(transposable): the final mask's forward and input-gradient GEMMs on the 2:4 kernels" in line(
        transposable=True, kernels=True
    )
    # a V100 (compute capability 7.0) has no sparse tensor cores: never measured
    assert "planned at 1.0x: no speed-up measured" in line(transposable=True, kernels=True)
