"""The 2:4 kernels' measured speed-up per GEMM shape and device, for the planner's time of a run with
``sparsity.kernels=true``: the forward and the input-gradient GEMMs of each targeted block matrix divided by it, the
weight gradient's (dense) not. ``semi_sparse_speedup.json`` holds what ``benchmarks/gpu_semi_sparse.py --record
DEVICE`` measured on a GPU (the forward's dense time over its 2:4 time, per ``tokens x fan_in -> fan_out``); a shape
or device not measured plans at 1.0, never at a figure from the literature or another shape."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

TABLE = Path(__file__).with_name("semi_sparse_speedup.json")


def shape_key(tokens: int, fan_in: int, fan_out: int) -> str:
    return f"{tokens} x {fan_in} -> {fan_out}"


def measured(device: str, table: Path = TABLE) -> dict[str, float]:
    """``device``'s measured factors by shape (empty where none is measured)."""
    return json.loads(table.read_text()).get(device, {}).get("speedup", {}) if table.is_file() else {}


def speedup_for(device: str, table: Path = TABLE) -> Callable[[int, int, int], float]:
    """(tokens, fan_in, fan_out) -> the measured factor on ``device``, 1.0 where that shape is not measured."""
    factors = measured(device, table)
    return lambda tokens, fan_in, fan_out: factors.get(shape_key(tokens, fan_in, fan_out), 1.0)
