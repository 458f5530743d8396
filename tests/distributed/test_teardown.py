"""Every trainer call builds an engine; its teardown releases the engine's process groups (threads, sockets,
communicators) and gradient-bucket hooks, so repeated calls in one process do not pile them up."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.distributed.launch import torchrun_script

SCRIPT = Path(__file__).with_name("run_repeated_calls.py")


DEPTHS = [2, 1]


@pytest.fixture(scope="module")
def called(tmp_path_factory) -> Path:
    """One job: both depths, one Trainer (and its four calls) after the other."""
    out = tmp_path_factory.mktemp("teardown")
    torchrun_script(SCRIPT, [str(out), *map(str, DEPTHS)], world=2, timeout=300)
    return out


@pytest.mark.parametrize("depth", DEPTHS, ids=["pipeline-d2", "replicas-w2"])
def test_repeated_trainer_calls_release_each_engines_groups_and_hooks(called, depth):
    for rank in (0, 1):
        records = json.loads((called / f"depth-{depth}" / f"rank-{rank}.json").read_text())
        assert [r["call"] for r in records] == ["fit", "validate 0", "validate 1", "validate 2"]
        for record in records:
            assert record["engine_groups"] >= 3, record  # pipeline, loss, replica (and links at depth 2)
            assert record["engine_groups_alive"] == 0, record
            assert record["hooks_left"] == 0, record
        threads = [r["threads"] for r in records]
        files = [r["open_files"] for r in records]
        assert threads[3] <= threads[1] and files[3] <= files[1], (threads, files)  # 15 threads per call before
        losses = [r["val_loss"] for r in records[1:]]
        assert all(math.isfinite(v) for v in losses) and max(losses) == min(losses), losses  # same weights
