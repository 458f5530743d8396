"""Issue 48: a tied weight is taken from the stage whose copy the initialisation wrote (``build._initialised_copy``),
not always from the first stage holding it. Before, the embedding's unwritten copy (the poison) was broadcast over
the head's initialised one and both stages refused with a false message ("init_pipeline_layer(index) left it
unwritten" for the weight the hook wrote)."""

from __future__ import annotations

import pytest
import torch

from .launch import ROOT, torchrun_script
from .run_tied_init import VOCAB, WIDTH, head_init

pytestmark = pytest.mark.smoke
SCRIPT = ROOT / "tests" / "distributed" / "run_tied_init.py"


def test_the_tied_weight_comes_from_the_stage_that_initialised_it(tmp_path):
    torchrun_script(SCRIPT, [str(tmp_path), "head"], 2, timeout=120)
    expected = torch.empty(VOCAB, WIDTH)
    head_init(expected)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert "error" not in result, result.get("error")
        torch.testing.assert_close(result["tied"], expected, rtol=0, atol=0, msg=f"rank {rank}")


def test_a_tied_weight_no_stage_initialised_is_refused_by_name(tmp_path):
    torchrun_script(SCRIPT, [str(tmp_path), "none"], 2, timeout=120)
    for rank in range(2):
        error = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True).get("error", "")
        assert "tied across stages [0, 1]" in error and "initialised by none of them" in error, error
