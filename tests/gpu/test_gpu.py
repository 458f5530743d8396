"""GPU checks (``make gpu-check``): marked ``gpu``, skipped where no CUDA device is present.

One process on one GPU, ``bf16-mixed``: the engine's device placement and the exactness of a 2BW run
with recomputation against the single-process bf16 reference of the same rule (``tests/distributed``);
``plan="auto"`` profiling on the device. Two pipeline stages need two GPUs under NCCL (it refuses two
ranks on one device); the NCCL transport itself is proven by ``tests/unit/test_nccl_model.py``.
"""

from __future__ import annotations

from dataclasses import replace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_pd2bw import PipeDream2BWStrategy
from lightning_pd2bw.callbacks import RunMetrics

from ..distributed.cases import SEQ_LEN, Case, build_model, dataloader
from ..distributed.reference import reference_weights

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


class Probe(Callback):
    """Records where Lightning thinks the module is, and the peak device memory."""

    def __init__(self) -> None:
        self.devices: set[str] = set()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        self.devices.add(str(pl_module.device))


def fit(case: Case, **strategy: object) -> tuple[pl.Trainer, Probe]:
    pl.seed_everything(0)
    probe = Probe()
    trainer = pl.Trainer(
        strategy=PipeDream2BWStrategy(mode=case.mode, recompute=case.recompute, failure_timeout=None, **strategy),
        accelerator="gpu",
        devices=1,
        precision=case.precision,
        max_steps=case.steps,
        limit_val_batches=0,
        logger=False,
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe, RunMetrics(global_batch_size=case.micro_batch * case.num_microbatches, seq_len=SEQ_LEN)],
    )
    trainer.fit(build_model(case), train_dataloaders=dataloader(case))
    return trainer, probe


@pytest.mark.parametrize(
    "precision,recompute,tolerance",
    [("32-true", False, 1e-5), ("bf16-mixed", False, 2e-3), ("bf16-mixed", True, 2e-3)],
)
def test_one_stage_2bw_equals_the_reference_on_the_gpu(precision, recompute, tolerance):
    """The engine on the GPU against the single-process reference of the same rule run on the same GPU (the
    same kernels); the distance to the Flush rule shows the tolerance separates the two rules."""
    case = Case("gpu", mode="2bw", num_stages=1, num_microbatches=2, steps=5, precision=precision, recompute=recompute)
    trainer, probe = fit(case, num_stages=1, num_microbatches=2)
    assert probe.devices == {"cuda:0"}, "pl_module.device is the GPU (not the CPU it was built on)"
    got = {k: v.float().cpu() for k, v in trainer.strategy.lightning_module_state_dict().items()}
    expected = reference_weights(case, 1, device="cuda")
    flush = reference_weights(replace(case, mode="flush"), 1, device="cuda")
    on_cpu = reference_weights(case, 1)  # the CPU's kernels round bf16 differently: printed, not asserted
    diff = max((got[k] - expected[k]).abs().max().item() for k in expected)
    to_flush = max((got[k] - flush[k]).abs().max().item() for k in expected)
    to_cpu = max((got[k] - on_cpu[k]).abs().max().item() for k in expected)
    print(
        f"\n[gpu-check] 2BW {precision} recompute={recompute}: max |engine - GPU reference| = {diff:.2e} "
        f"(tolerance {tolerance:.0e}), to the flush rule {to_flush:.2e}, to the CPU reference {to_cpu:.2e}"
    )
    assert diff < tolerance, "the engine on the GPU follows the 2BW rule"
    assert to_flush > 5 * tolerance, "the tolerance tells 2BW from Flush"


def test_plan_auto_profiles_on_the_gpu():
    case = Case("gpu_plan", mode="2bw", num_stages=1, num_microbatches=2, steps=2, precision="bf16-mixed")
    trainer, probe = fit(case, plan="auto", global_batch_size=case.micro_batch * case.num_microbatches)
    assert probe.devices == {"cuda:0"}
    assert trainer.strategy.planned is not None
    print(f"\n[gpu-check] plan=auto on {torch.cuda.get_device_name()}: {trainer.strategy.planned.candidate}")
