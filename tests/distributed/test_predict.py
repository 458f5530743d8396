"""``trainer.predict`` under ``strategy="pd2bw"``: every rank gets the predictions, in order, equal to the plain
module's (greedy generation of a few tokens from the pipelined GPT)."""

from __future__ import annotations

from pathlib import Path

import torch

from .launch import torchrun_script
from .predict_case import generate_plain


def test_greedy_generation_equals_the_plain_module(tmp_path):
    torchrun_script(Path(__file__).with_name("run_predict.py"), [str(tmp_path)], 2)
    tokens, logits = generate_plain()
    for rank in range(2):
        got = torch.load(tmp_path / f"generated-rank-{rank}.pt", weights_only=True)
        assert torch.equal(got["tokens"], tokens), f"rank {rank}"
        torch.testing.assert_close(got["logits"], logits, rtol=1e-5, atol=1e-5)
