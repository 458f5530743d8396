"""RunMetrics: tokens/s, samples/s and MFU from Lightning's Throughput, counted once per pipeline."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from lightning_pd2bw import PipeDream2BWStrategy
from lightning_pd2bw.data import LMDataset
from lightning_pd2bw.engine.precision import Precision
from lightning_pd2bw.lightning.callbacks import RunMetrics
from lightning_pd2bw.models import GPT, GPTConfig

SEQ, BATCH, PEAK = 16, 4, 1e12


class Logged(Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        metrics = trainer.callback_metrics
        if "mfu" in metrics and trainer.global_step % trainer.log_every_n_steps == 0:
            self.rows.append({k: float(metrics[k]) for k in ("mfu", "tokens_per_sec", "samples_per_sec")})


@pytest.mark.parametrize("strategy", ["pd2bw", "auto"])
def test_mfu_is_the_models_flops_over_the_peak(strategy):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=SEQ))
    logged = Logged()
    trainer = pl.Trainer(
        strategy=PipeDream2BWStrategy(num_stages=1, num_microbatches=2, failure_timeout=None)
        if strategy == "pd2bw"
        else "auto",
        accelerator="cpu",
        devices=1,
        max_steps=6,
        log_every_n_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[RunMetrics(BATCH, SEQ, peak_flops=PEAK), logged],
    )
    data = LMDataset(torch.randint(0, 256, (BATCH * SEQ * 8,), dtype=torch.uint8), SEQ)
    trainer.fit(model, DataLoader(data, batch_size=BATCH, drop_last=True))
    assert len(logged.rows) == 3
    for row in logged.rows:
        assert row["tokens_per_sec"] == pytest.approx(row["samples_per_sec"] * SEQ)
        assert row["mfu"] == pytest.approx(row["tokens_per_sec"] * model.flops_per_token() / PEAK, rel=1e-4)


def test_compute_dtype_of_precision_settings():
    assert Precision.of("bf16-mixed").compute_dtype == torch.bfloat16
    assert Precision.of("16-mixed").compute_dtype == torch.float16
    assert Precision.of("32-true").compute_dtype == Precision.of(32).compute_dtype == torch.float32


@pytest.mark.parametrize(
    "shape", [dict(n_layer=2, n_head=2, n_embd=32, block_size=64), dict(n_layer=3, n_head=4, n_embd=64, block_size=32)]
)
def test_the_models_flop_formula_matches_torchs_flop_counter(shape):
    """MFU's numerator, ``flops_per_token()`` (6N + 12 L T d), against an independent count: torch's
    ``FlopCounterMode`` over one forward and backward of the module (every matmul and attention op it dispatches)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    model = GPT(GPTConfig(**shape))
    model.configure_model()
    batch, seq = 2, shape["block_size"]
    tokens = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(0))
    # attention through its math kernel: matmuls the counter sees (the fused CPU kernel has no FLOP formula)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(tokens).float().pow(2).mean().backward()
    counted = counter.get_total_flops() / (batch * seq)
    assert model.flops_per_token() == pytest.approx(counted, rel=0.01)
