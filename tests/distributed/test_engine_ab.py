"""``benchmarks/engine_ab.py`` runs as its docstring says (torchrun, two settings alternated), on a tiny GPT."""

from __future__ import annotations

import os
import subprocess
import sys

from .launch import ROOT


def test_engine_ab_alternates_two_settings_and_reports_their_ratio():
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), BENCH_LAYERS="4", BENCH_WIDTH="32", BENCH_SEQ="32"
    )
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    script = ["benchmarks/engine_ab.py", '{"lookahead": 1}', "--rounds", "2", "--steps", "2", "--microbatches", "4"]
    done = subprocess.run([*launcher, *script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    out = done.stdout
    assert "A = {}, B = {'lookahead': 1}; depth 2, m = 4" in out
    assert "round  1 (AB)" in out and "round  2 (BA)" in out and "B/A over 2 rounds: median" in out
