"""The callbacks ``docs/from-lightning.md`` shows (``examples/callbacks.py``), run under ``strategy="pd2bw"``: the
metric reaches the logger, and the stage's moving average equals the one computed by hand from the weights the
callbacks saw at each step."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_pd2bw import PipeDream2BWStrategy
from lightning_pd2bw.data import LMDataset
from lightning_pd2bw.models import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[2]
SEQ, BATCH = 16, 4


def example():
    spec = importlib.util.spec_from_file_location("callbacks_example", ROOT / "examples" / "callbacks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Seen(pl.Callback):
    """The stage's weights at each step's end, and what was logged."""

    def __init__(self) -> None:
        self.weights: list[dict[str, torch.Tensor]] = []
        self.logged: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        self.weights.append({n: p.detach().float().clone() for n, p in trainer.strategy.stage_parameters()})
        if "lr" in trainer.callback_metrics:
            self.logged.append(float(trainer.callback_metrics["lr"]))


def test_the_documented_callbacks_run_under_the_pipeline():
    callbacks = example()
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=SEQ))
    ema, seen = callbacks.StageEMA(decay=0.5), Seen()
    trainer = pl.Trainer(
        strategy=PipeDream2BWStrategy(num_stages=1, num_microbatches=2, failure_timeout=None),
        accelerator="cpu",
        devices=1,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callbacks.LogLearningRate(), ema, seen],  # seen after the others: the same weights
    )
    data = LMDataset(torch.randint(0, 256, (BATCH * SEQ * 8,), dtype=torch.uint8), SEQ)
    trainer.fit(model, DataLoader(data, batch_size=BATCH, drop_last=True))
    assert len(seen.logged) == 4 and all(lr > 0 for lr in seen.logged)
    assert set(ema.average) == set(seen.weights[0]) and len(seen.weights) == 4
    assert any(not torch.equal(seen.weights[0][n], seen.weights[-1][n]) for n in ema.average), "training moved them"
    for name, average in ema.average.items():
        expected = seen.weights[0][name]
        for weights in seen.weights[1:]:
            expected = 0.5 * expected + 0.5 * weights[name]
        torch.testing.assert_close(average, expected, rtol=4e-6, atol=1e-7)  # 3 lerps, a few float32 ulps each
