"""Soak: a few hundred 2BW steps with validation and checkpoints every 40 steps (``make soak`` runs
``PD2BW_SOAK_STEPS=3000``).

Bounded: resident memory after warm-up grows by less than ``RSS_GROWTH`` over the rest of the run, and the
engine never holds more than two weight versions, d - r stashed microbatches or a few pending entries.
"""

from __future__ import annotations

import json
import os

from lightning_pd2bw.checkpoint import read_manifest

from .launch import ROOT, torchrun_script

STEPS = int(os.environ.get("PD2BW_SOAK_STEPS", 400))
RSS_GROWTH = 16 * 2**20  # bytes, from step 100 to the end (measured: < 2 MiB over 300 steps, ~370 MiB processes)


def test_soak_2bw_with_validation_and_checkpoints(tmp_path):
    torchrun_script(ROOT / "tests" / "distributed" / "run_soak.py", [str(tmp_path), str(STEPS)], 2, timeout=1200)
    for rank in range(2):
        points = json.loads((tmp_path / f"soak-rank-{rank}.json").read_text())
        assert points[-1]["step"] == STEPS
        warm = next(p for p in points if p["step"] >= 100)
        growth = max(p["rss"] for p in points) - warm["rss"]
        assert growth < RSS_GROWTH, f"rank {rank}: resident memory grew {growth / 2**20:.1f} MiB after step 100"
        assert max(p["versions"] for p in points) <= 2
        assert max(p["stashed"] for p in points) <= 2 - rank
        assert max(p["losses"] for p in points) <= 3 and max(p["hparams"] for p in points) <= 3
        assert max(p["step_map"] for p in points) <= 4 and max(p["in_flight"] for p in points) <= 8
    kept = sorted(tmp_path.glob("ckpt/*.ckpt"))
    assert len(kept) == 2, kept  # save_top_k=2: older checkpoints were removed
    assert read_manifest(kept[-1])["global_step"] in (STEPS - STEPS % 40, STEPS)
