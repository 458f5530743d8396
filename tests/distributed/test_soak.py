"""Soak: long runs with bounded memory and bounded engine bookkeeping (``make soak`` runs 3000 steps).

* without drains (no validation, no checkpoint), 500 steps in each mode: 2BW never drains, so every
  buffer must be retired as it goes (the transport before today's leaked every boundary send under gloo: +100 MiB
  and 3640 held sends per stage over 1000 steps of this model: over the 400 steps measured here, 2.5 times the
  memory bound, and the sends bound at once);
* with validation and a checkpoint every 40 steps, 240 steps (2BW drains and restarts its versions each time).

Bounded: resident memory after step 100 grows by less than ``RSS_GROWTH``; the engine never holds more
than two weight versions, d - r stashed microbatches, two segments' sends or a few pending entries.
"""

from __future__ import annotations

import json
import os

import pytest

from lightning_pd2bw.checkpoint import read_manifest

from .launch import ROOT, torchrun_script

STEPS = int(os.environ.get("PD2BW_SOAK_STEPS", 0))  # 0: each test's own length
RSS_GROWTH = 16 * 2**20  # bytes from step 100 to the end (measured +2-4 MiB over 900 steps, ~365 MiB processes)
SENDS = 8  # 2 segments x 4 microbatches x (1 activation or 1 gradient tensor) per stage at d=2, m=4


def soak(tmp_path, steps: int, mode: str, drains: bool) -> list[list[dict]]:
    args = [str(tmp_path), str(steps), mode, "drains" if drains else "none"]
    torchrun_script(ROOT / "tests" / "distributed" / "run_soak.py", args, 2, timeout=1200)
    runs = [json.loads((tmp_path / f"soak-rank-{rank}.json").read_text()) for rank in range(2)]
    for rank, points in enumerate(runs):
        assert points[-1]["step"] == steps
        warm = next(p for p in points if p["step"] >= 100)
        growth = max(p["rss"] for p in points) - warm["rss"]
        assert growth < RSS_GROWTH, f"rank {rank}: resident memory grew {growth / 2**20:.1f} MiB after step 100"
        assert max(p["versions"] for p in points) <= (2 if mode == "2bw" else 1)
        assert max(p["stashed"] for p in points) <= 2 - rank
        assert max(p["sends"] for p in points) <= SENDS, f"rank {rank}: sends not retired"
        assert max(p["losses"] for p in points) <= 3 and max(p["hparams"] for p in points) <= 3
        assert max(p["step_map"] for p in points) <= 4 and max(p["in_flight"] for p in points) <= 8
    return runs


@pytest.mark.parametrize("mode", ["2bw", "flush"])
def test_soak_without_drains(tmp_path, mode):
    soak(tmp_path, STEPS or 500, mode, drains=False)


def test_soak_2bw_with_validation_and_checkpoints(tmp_path):
    steps = STEPS or 240
    soak(tmp_path, steps, "2bw", drains=True)
    kept = sorted(tmp_path.glob("ckpt/*.ckpt"))
    assert len(kept) == 2, kept  # save_top_k=2: older checkpoints were removed
    assert read_manifest(kept[-1])["global_step"] in (steps - steps % 40, steps)
