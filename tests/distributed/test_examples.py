"""The README's "Bring your own model" examples, run as a user runs them: ``python examples/...`` (Lightning's own
launcher starts the second process)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from .launch import ROOT


def run_example(*args: str) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    # both ranks write to one pipe: rank 0's progress bar may follow a number without a newline ("0.2968Epoch 0: ...")
    losses = [float(v) for v in re.findall(r"final train_loss (-?\d+\.\d{4})", done.stdout)]
    assert len(losses) == 2, "both ranks finish and report"
    return losses[0]


def test_plain_module_learns():
    assert run_example("examples/plain_module.py") < 1.0  # the target's variance is 4


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_hugging_face_model_trains(family):
    pytest.importorskip("transformers")
    loss = run_example("examples/hf_models.py", family)
    assert 0 < loss < 6.0  # random tokens over a 128-token vocabulary: ln(128) = 4.85 at best
