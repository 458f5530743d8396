"""The 2:4 kernels' path (``sparsity/semi_sparse.py``) on the CPU, through an emulation of PyTorch's CUTLASS
semi-structured tensor: its ``prune_dense_static_sort`` keeps what the CUDA tile kernel keeps (the selection written
from its source), so the wiring (which weights the kernels are handed, when they switch on, both GEMMs' orientation)
is checked here, and only the kernels' arithmetic and speed are left to ``tests/gpu/test_semi_sparse_gpu.py``."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_pd2bw import PipeDream2BWStrategy
from lightning_pd2bw.sparsity import SemiStructuredSparsity, semi_sparse
from lightning_pd2bw.sparsity.semi_sparse import use_kernels
from lightning_pd2bw.sparsity.transposable import transposable_mask


def _cuda_tile_selection(tile: torch.Tensor, algorithm: str) -> torch.Tensor:
    """Which cells of a 4 x 4 tile the CUDA tile kernel keeps (``torch._sparse_semi_structured_tile``, written from
    aten/src/ATen/native/sparse/cuda/ComputeSparseTile.h: ``LargestValuesGreedy`` takes the values largest first,
    each while its row and its column hold fewer than 2; "" and "largest_values_greedy" rank by signed value,
    "largest_abs_values_greedy" by magnitude)."""
    ranks = {"": tile, "largest_values_greedy": tile, "largest_abs_values_greedy": tile.abs()}[algorithm].flatten()
    rows, cols, kept = [0] * 4, [0] * 4, torch.zeros(16, dtype=torch.bool)
    for cell in sorted(range(16), key=lambda i: float(ranks[i]), reverse=True):
        r, c = divmod(cell, 4)
        if rows[r] < 2 and cols[c] < 2:
            kept[cell], rows[r], cols[c] = True, rows[r] + 1, cols[c] + 1
    return kept.reshape(4, 4)


class _EmulatedCutlass:
    """``SparseSemiStructuredTensorCUTLASS`` on the CPU: ``prune_dense_static_sort`` keeps what the CUDA kernel keeps
    (``_cuda_tile_selection``), and the product with a dense matrix is the kept matrix's (both orientations, as the
    real tensor holds W and W.t() packed)."""

    algorithms: list[str] = []  # every call's algorithm, in order

    def __init__(self, kept: torch.Tensor) -> None:
        self.kept = kept

    @classmethod
    def prune_dense_static_sort(cls, dense: torch.Tensor, algorithm: str = "") -> _EmulatedCutlass:
        cls.algorithms.append(algorithm)
        rows, cols = dense.shape
        tiles = dense.reshape(rows // 4, 4, cols // 4, 4).transpose(1, 2)
        keep = torch.stack([torch.stack([_cuda_tile_selection(t, algorithm) for t in row]) for row in tiles])
        return cls(dense * keep.transpose(1, 2).reshape(rows, cols))

    def t(self) -> torch.Tensor:
        return self.kept.t()

    def __rmatmul__(self, other: torch.Tensor) -> torch.Tensor:
        return other @ self.kept


def test_the_kernels_compress_every_non_zero_of_a_transposable_weight_negative_ones_included(monkeypatch):
    """The CUDA tile kernel's default ranks a tile's values by sign, so a zero takes a negative weight's place and the
    kernels compute with another matrix: the kernels ask it to rank by magnitude, and the forward and both gradients
    of the layer through the (emulated) kernels equal the dense masked layer's."""
    torch.manual_seed(0)
    layer = nn.Linear(64, 128)
    with torch.no_grad():
        layer.weight.mul_(transposable_mask(layer.weight.abs(), 2, 4))
    default = _EmulatedCutlass.prune_dense_static_sort(layer.weight.detach(), "").kept
    assert default.ne(layer.weight).any()  # the hazard is real for this weight: the default drops negative values
    monkeypatch.setattr(torch.sparse, "SparseSemiStructuredTensorCUTLASS", _EmulatedCutlass)
    monkeypatch.setattr(semi_sparse, "device_backend", lambda device: "cutlass")  # an A100 (8.0)
    x = torch.randn(3, 5, 64, requires_grad=True)
    grad = torch.randn(3, 5, 128)
    results = []
    for kernels in (False, True):
        use_kernels(layer, kernels)
        layer(x).backward(grad)
        results.append([layer(x).detach(), x.grad, layer.weight.grad, layer.bias.grad])
        x.grad = layer.weight.grad = layer.bias.grad = None
    use_kernels(layer, False)
    for dense, sparse in zip(*results):
        # float32 sums of at most 128 terms in another order: |error| <= 128 eps sum|a b|, about 1.5e-5 per unit of
        # sum|a b| (<= ~5 for these unit-variance inputs and weights of ~0.1); a dropped weight moves outputs by ~0.1
        torch.testing.assert_close(sparse, dense, rtol=1e-4, atol=1e-4)
    assert _EmulatedCutlass.algorithms[-1] == "largest_abs_values_greedy"


class KernelsSeen(Callback):
    """Counts the steps that ended with the kernels on, and checks the weights then are 2:4 along both dimensions
    (what the compression keeps is all there is); the GPU test uses it too."""

    def __init__(self) -> None:
        self.steps_on = 0

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        on = [m for m in pl_module.modules() if isinstance(m, nn.Linear) and "forward" in m.__dict__]
        self.steps_on += bool(on)
        for layer in on:
            nonzero = layer.weight.detach().ne(0)
            rows, cols = nonzero.shape
            assert nonzero.reshape(rows, cols // 4, 4).sum(-1).le(2).all()
            assert nonzero.t().reshape(cols, rows // 4, 4).sum(-1).le(2).all()


@pytest.fixture
def emulated_kernels(monkeypatch):
    """The kernels' path on the CPU: the emulated CUTLASS tensor, and the device refusal lifted (the others kept)."""
    refusal = semi_sparse.refusal

    def on_any_device(name, module, device, dtype):
        return refusal(name, module, torch.device("cuda"), torch.bfloat16) if device.type == "cpu" else None

    monkeypatch.setattr(torch.sparse, "SparseSemiStructuredTensorCUTLASS", _EmulatedCutlass)  # an A100's backend
    monkeypatch.setattr(torch.sparse, "SparseSemiStructuredTensorCUSPARSELT", None)  # never picked at 8.0
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(semi_sparse, "device_backend", lambda device: semi_sparse.backend((8, 0), cusparselt=False))
    monkeypatch.setattr(semi_sparse, "refusal", on_any_device)


def test_a_2bw_run_with_the_kernels_trains_as_the_dense_gemms_do(emulated_kernels):
    """The mask thins 3:4 -> 2:4 while 2BW's versions are in flight (steps 1-3); the kernels switch on two updates
    after the final mask. Were they on while a version still held a third weight of 4, the (emulated) compression
    would drop it and the run would part from the dense GEMMs' one: here it ends equal, in float32."""
    from lightning_pd2bw.models import GPT, GPTConfig

    from .test_sparsity_training import SEQ, fit

    weights, seen = {}, {}
    for kernels in (False, True):
        seen[kernels] = KernelsSeen()
        sparsity = SemiStructuredSparsity(
            start_step=1, end_step=3, update_interval=1, transposable=True, kernels=kernels
        )
        module = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=64, block_size=SEQ), lr=1e-2)
        fit(
            module,
            [sparsity, seen[kernels]],
            8,
            strategy=PipeDream2BWStrategy(mode="2bw", num_microbatches=2, sync_steps=0),
        )
        weights[kernels] = {k: v.detach().clone() for k, v in module.state_dict().items()}
    assert seen[True].steps_on >= 3 and seen[False].steps_on == 0
    for key, dense in weights[False].items():
        # Rounding apart (another GEMM's summation order) the runs are equal; AdamW could flip one near-zero
        # update, 2 lr = 0.02 on one of >= 4,096 weights of ~0.05 (0.4% of a matrix's norm). A forward reading a
        # 3:4 version through the kernels parts the matrices by ~36% (measured with the switch one update early).
        assert ((weights[True][key] - dense).norm() / dense.norm()).item() < 5e-2, key


def test_each_device_gets_the_backend_that_runs_there():
    """Issue 95: PyTorch's CUTLASS 2:4 GEMM accepts compute capability 8.x only; Hopper (9.0) and later run
    cuSPARSELt; below 8.0, or at 9.0 without cuSPARSELt, nothing does."""
    assert semi_sparse.backend((8, 0), cusparselt=True) == "cutlass"
    assert semi_sparse.backend((8, 9), cusparselt=False) == "cutlass"
    assert semi_sparse.backend((9, 0), cusparselt=True) == "cusparselt"
    assert semi_sparse.backend((10, 0), cusparselt=True) == "cusparselt"
    assert semi_sparse.backend((9, 0), cusparselt=False) is None
    assert semi_sparse.backend((7, 5), cusparselt=True) is None


@pytest.mark.parametrize(
    "capability,cusparselt,message",
    [
        ((9, 0), False, r"compute capability \(9, 0\): no 2:4 backend runs there .*this PyTorch lacks it"),
        ((7, 5), True, r"compute capability \(7, 5\): no 2:4 backend"),
        ((9, 0), True, r"is 192 x 64: cusparselt's tile needs both dimensions multiples of 128"),
        ((8, 0), True, None),  # CUTLASS's tile is 64: the layer runs
    ],
)
def test_the_refusal_names_the_device_and_the_backend(monkeypatch, capability, cusparselt, message):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "the GPU")
    monkeypatch.setattr(torch.backends.cusparselt, "is_available", lambda: cusparselt)
    reason = semi_sparse.refusal("h.0.mlp.fc", nn.Linear(64, 192), torch.device("cuda"), torch.bfloat16)
    if message is None:
        assert reason is None
    else:
        assert reason is not None and __import__("re").search(message, reason), reason
