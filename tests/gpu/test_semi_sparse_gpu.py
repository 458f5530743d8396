"""GPU checks of the 2:4 kernels (``make gpu-check``; skipped without CUDA): a masked Linear through the sparse
tensor cores computes what the dense masked GEMM computes, and a pipeline run with ``kernels=True`` trains as the
same run on dense GEMMs does (the CPU proofs of the masks and the refusals: ``tests/unit/test_transposable_2of4.py``)."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_pd2bw import PipeDream2BWStrategy
from lightning_pd2bw.sparsity import SemiStructuredSparsity
from lightning_pd2bw.sparsity.semi_sparse import use_kernels
from lightning_pd2bw.sparsity.transposable import transposable_mask

from ..unit.test_semi_sparse_emulated import KernelsSeen

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
        reason="needs a CUDA device of compute capability 8.0 or more",
    ),
]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_the_kernels_compute_the_dense_masked_gemms_forward_and_backward():
    torch.manual_seed(0)
    layer = nn.Linear(256, 512).cuda().bfloat16()
    with torch.no_grad():
        layer.weight.mul_(transposable_mask(layer.weight.abs(), 2, 4))
    x = torch.randn(3, 40, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # rows padded by torch
    grad = torch.randn(3, 40, 512, device="cuda", dtype=torch.bfloat16)
    results = []
    for kernels in (False, True):
        use_kernels(layer, kernels)
        out = layer(x)
        out.backward(grad)
        results.append([out.detach(), x.grad, layer.weight.grad, layer.bias.grad])
        x.grad = layer.weight.grad = layer.bias.grad = None
    use_kernels(layer, False)
    for dense, sparse in zip(*results):
        assert _relative(sparse, dense) < 1e-2  # bfloat16's rounding of GEMMs of 256-512 terms, not a rule's gap


def test_a_pipeline_run_with_the_kernels_trains_as_the_dense_gemms_do():
    """The mask thins 3:4 -> 2:4 while 2BW's versions are in flight (steps 1-3); the kernels switch on two updates
    after the final mask. Were they on while a version still held a third weight of 4, the compression would drop it
    and the weights would part from the dense GEMMs' run by far more than bfloat16's rounding."""
    from torch.utils.data import DataLoader

    from lightning_pd2bw.data import LMDataset, read_corpus
    from lightning_pd2bw.models import GPT, GPTConfig

    weights, seen = {}, {}
    for kernels in (False, True):
        pl.seed_everything(0)
        seen[kernels] = KernelsSeen()
        sparsity = SemiStructuredSparsity(
            start_step=1, end_step=3, update_interval=1, transposable=True, kernels=kernels
        )
        trainer = pl.Trainer(
            strategy=PipeDream2BWStrategy(mode="2bw", num_microbatches=2, sync_steps=0),  # versions in flight at once
            accelerator="gpu",
            devices=1,
            precision="bf16-mixed",
            max_steps=10,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[sparsity, seen[kernels]],
        )
        module = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=128, block_size=32), lr=1e-3)
        trainer.fit(module, DataLoader(LMDataset(read_corpus(max_bytes=40_000), 32), batch_size=8, drop_last=True))
        weights[kernels] = {k: v.detach().float().clone() for k, v in module.state_dict().items()}
    assert seen[True].steps_on >= 3 and seen[False].steps_on == 0
    for key, dense in weights[False].items():
        assert _relative(weights[True][key], dense) < 1e-2, key
