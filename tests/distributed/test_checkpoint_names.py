"""One parameter naming: a checkpoint written by the Lightning strategy loads into a plain ``PipelineEngine`` and
one written by ``engine.save`` loads under the strategy (``run_checkpoint_names.py``). Before 0.2.0 the engine
wrote ``model/<layer index>.<name>`` and the strategy ``model/<module name>``: neither found the other's entries."""

from __future__ import annotations

import pytest
import torch

from .launch import ROOT, torchrun_script

pytestmark = pytest.mark.smoke


def test_engine_and_strategy_checkpoints_load_into_each_other(tmp_path):
    torchrun_script(ROOT / "tests" / "distributed" / "run_checkpoint_names.py", [str(tmp_path)], 2, timeout=300)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        written, loaded = result["written"], result["loaded"]
        assert written["weights"] and set(loaded["weights"]) == set(written["weights"])
        assert any(".attn." in name for name in written["weights"]), "the module's names, not layer indices"
        for name, value in written["weights"].items():
            torch.testing.assert_close(loaded["weights"][name], value, rtol=0, atol=0, msg=name)
        assert set(loaded["moments"]) == set(written["moments"]) and written["moments"]
        for name, value in written["moments"].items():
            torch.testing.assert_close(loaded["moments"][name], value, rtol=0, atol=0, msg=name)
        saved, validated = result["saved"], result["validated"]
        assert set(validated) == set(saved)
        for name, value in saved.items():
            torch.testing.assert_close(validated[name], value, rtol=0, atol=0, msg=name)
        moved = max((saved[k] - written["weights"][k]).abs().max().item() for k in saved)
        assert moved > 0, "the engine's step changed the weights: the last check compares two different states"
