"""The "Bring your own model" examples (docs/models.md), run as a user runs them: ``python examples/...`` (Lightning's own
launcher starts the second process)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from .launch import ROOT

FAMILIES = ["gpt2", "llama", "bert"]


def run_example(*args: str, names: tuple[str, ...] = ("",)) -> dict[str, float]:
    """Rank 0's final train loss of each run the example reports, by the run's name ("gpt2: final train_loss ...";
    "" for an example of one unnamed run); both ranks must report every run."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    losses = {}
    for name in names:
        # both ranks write to one pipe: rank 0's progress bar may follow a number without a newline ("0.2968Epoch...")
        prefix = f"{name}: " if name else ""
        found = [float(v) for v in re.findall(rf"{prefix}final train_loss (-?\d+\.\d{{4}})", done.stdout)]
        assert len(found) == 2, f"both ranks finish {name or 'the run'} and report it"
        losses[name] = found[0]
    return losses


def test_plain_module_learns():
    assert run_example("examples/plain_module.py")[""] < 1.0  # the target's variance is 4


@pytest.fixture(scope="module")
def hugging_face_losses() -> dict[str, float]:
    """One run of the example for the three families, one Trainer after another (as its docstring shows)."""
    pytest.importorskip("transformers")
    return run_example("examples/hf_models.py", *FAMILIES, names=tuple(FAMILIES))


@pytest.mark.parametrize("family", FAMILIES)
def test_hugging_face_model_trains(hugging_face_losses, family):
    # English text as ASCII ids: a uniform guess scores ln 128 = 4.85; 30 steps reach 3.0-3.6 (measured 2026-11-24)
    assert 0 < hugging_face_losses[family] < 4.0


@pytest.mark.smoke  # also in make test: the README's plain PyTorch example under torchrun
def test_plain_pytorch_example_learns(tmp_path):
    """The "Without Lightning" example (README, docs/engine.md) under torchrun, as a user runs it: 2 stages, 2BW."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    done = subprocess.run(
        [*command, "examples/train_plain.py", "--steps", "40", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    found = re.findall(r"rank (\d): final train_loss (\d+\.\d{4}) val_loss (\d+\.\d{4})", done.stdout)
    assert sorted(rank for rank, _, _ in found) == ["0", "1"]
    assert len({(train, val) for _, train, val in found}) == 1, "both stages report the pipeline's losses"
    assert float(found[0][2]) < 3.6  # bytes: ln(256) = 5.55 untrained
    states = [torch.load(tmp_path / f"rank-{r}.pt", weights_only=False) for r in range(2)]
    assert [s["layout"]["stage"] for s in states] == [0, 1] and not set(states[0]["layers"]) & set(states[1]["layers"])
