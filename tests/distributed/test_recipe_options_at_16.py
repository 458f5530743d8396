"""Issue 95: the multi-GPU risks retired on CPU first. Sixteen gloo processes (4 stages x 4 replicas) train the tiny
GPT with every option the gpt13b recipe sets (``slow_cases.SLOW_CASES``), exactly as the single-process reference
computes the rule, resume from the asynchronous checkpoint bit for bit, and the calls they recorded replay under
NCCL's semantics without a deadlock, kernels one at a time included. Slow tier (16 processes on the 2-core machine)::

    .venv/bin/python -m pytest -m slow tests/distributed/test_recipe_options_at_16.py
"""

from __future__ import annotations

import pytest
import torch

from lightning_pd2bw.engine.verify.nccl_model import simulate

from .launch import torchrun
from .slow_cases import SLOW_CASES
from .test_equivalence import Float32Bound, merged
from .test_nccl_traces import recorded

NAME = "gpt_2bw_d4w4_recipe_options"


@pytest.mark.slow
def test_sixteen_ranks_with_the_recipes_options_train_the_rule(tmp_path):
    case = SLOW_CASES[NAME]
    torchrun(tmp_path, case.world, [NAME], timeout=1200)
    folder = tmp_path / NAME
    Float32Bound(case, case.width).check(merged(folder), NAME)
    uninterrupted, resumed = merged(folder), merged(folder, "resumed-stage-")
    assert set(uninterrupted) == set(resumed)
    for key in uninterrupted:
        torch.testing.assert_close(resumed[key], uninterrupted[key], rtol=0, atol=0)
    calls = recorded(folder)
    assert len(calls) == 16
    outcome = simulate(calls)
    assert outcome.steps > 0 and simulate(calls, serialized=True).steps == outcome.steps
