"""The flush schedule's gradients equal those of torch.distributed.pipelining's Schedule1F1B."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .launch import torchrun_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("world", [2, 4])
def test_flush_gradients_equal_schedule_1f1b(tmp_path, world):
    torchrun_script(Path(__file__).with_name("run_pipelining.py"), [str(tmp_path)], world, timeout=300)
    for rank in range(world):
        grads = torch.load(tmp_path / f"grads-{rank}.pt", weights_only=True)
        assert len(grads["ours"]) == len(grads["theirs"]) == 4
        for ours, theirs in zip(grads["ours"], grads["theirs"]):
            assert ours.abs().sum() > 0
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
