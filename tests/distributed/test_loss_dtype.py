"""The loss broadcast's receive buffer is typed as what is sent (float32), not by the default dtype: under
``trainer.precision=64`` the first stage reported ``5.36e-315`` (a float32 read as float64) before 0.2.0."""

from __future__ import annotations

import pytest
import torch

from .launch import ROOT, torchrun_script

pytestmark = pytest.mark.smoke


def test_every_stage_reports_the_last_stages_loss_under_float64(tmp_path):
    torchrun_script(ROOT / "tests" / "distributed" / "run_loss_dtype.py", [str(tmp_path)], 2, timeout=120)
    first, last = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    assert len(last) == 3 and all(0.01 < loss < 100 for loss in last), last
    assert first == last
