"""Transposable 2:4 masks (``sparsity/transposable.py``) and the 2:4 kernels' switch and refusals
(``sparsity/semi_sparse.py``, ``SemiStructuredSparsity(kernels=True)``; the kernels themselves need a CUDA GPU)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from lightning_pd2bw.sparsity import MaskUpdate, SemiStructuredSparsity, Sparsifier
from lightning_pd2bw.sparsity.semi_sparse import check, refusal, use_kernels
from lightning_pd2bw.sparsity.transposable import patterns, transposable_mask


def _best_by_enumeration(tile: torch.Tensor, n: int) -> float:
    """The largest kept magnitude of a 4 x 4 tile over every choice of 4n cells with n per row and column: the
    reference, enumerated independently of the pattern table."""
    best = -1.0
    for cells in itertools.combinations(range(16), 4 * n):
        rows = [sum(1 for c in cells if c // 4 == r) for r in range(4)]
        cols = [sum(1 for c in cells if c % 4 == k) for k in range(4)]
        if rows == [n] * 4 and cols == [n] * 4:
            best = max(best, float(sum(tile.flatten()[c] for c in cells)))
    return best


def test_the_pattern_tables_hold_every_tile_with_n_per_row_and_column():
    assert [len(patterns(n, 4)) for n in (1, 2, 3, 4)] == [24, 90, 24, 1]  # 4!, the 2-regular 4 x 4 count, 4!, 1
    for n in (1, 2, 3):
        tiles = patterns(n, 4).reshape(-1, 4, 4)
        assert tiles.sum(1).eq(n).all() and tiles.sum(2).eq(n).all()
        assert len({tuple(t.flatten().tolist()) for t in tiles}) == len(tiles)
    with pytest.raises(ValueError, match="m <= 4"):
        patterns(2, 8)
    with pytest.raises(ValueError, match=r"m <= 4; set m=4 or transposable=False"):
        SemiStructuredSparsity(n=2, m=8, transposable=True)


@pytest.mark.parametrize("n", [2, 3])
def test_each_tile_keeps_the_largest_magnitude_pattern_with_n_per_row_and_column(n):
    generator = torch.Generator().manual_seed(n)
    score = torch.rand(8, 12, generator=generator)
    mask = transposable_mask(score, n, 4)
    tiles = mask.reshape(2, 4, 3, 4).transpose(1, 2)  # 2 x 3 tiles of 4 x 4
    assert tiles.sum(-1).eq(n).all() and tiles.sum(-2).eq(n).all()  # n of 4 in every row and every column
    assert mask.reshape(8, 3, 4).sum(-1).eq(n).all() and mask.t().reshape(12, 2, 4).sum(-1).eq(n).all()
    for r, c in itertools.product(range(2), range(3)):
        tile = score[4 * r : 4 * r + 4, 4 * c : 4 * c + 4]
        kept = float(tile[mask[4 * r : 4 * r + 4, 4 * c : 4 * c + 4]].sum())
        assert kept == pytest.approx(_best_by_enumeration(tile, n), rel=1e-6)


def test_the_sparsifier_prunes_to_a_transposable_mask_and_refuses_a_shape_it_cannot_tile():
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(8, 16))
    sparsifier = Sparsifier({"w": weight})
    sparsifier.update(1, MaskUpdate("n_of_m", density=0.5, n=2, m=4, transposable=True))
    mask = sparsifier.masks["w"]
    assert mask.reshape(8, 4, 4).sum(-1).eq(2).all() and mask.t().reshape(16, 2, 4).sum(-1).eq(2).all()
    assert weight.detach()[~mask].eq(0).all() and sparsifier.layer_targets == {"w": 0.5}
    plain = Sparsifier({"blocks.0.fc.weight": nn.Parameter(torch.zeros(6, 8))})
    plain.check_groups(4)  # the input features group by 4
    with pytest.raises(ValueError, match=r"blocks.0.fc.weight \[6, 8\] cannot be grouped by 4 along both dimensions"):
        plain.check_groups(4, transposable=True)
    schedule = SemiStructuredSparsity(start_step=2, end_step=4, update_interval=1, transposable=True)
    assert schedule.plan(2).transposable and (schedule.plan(2).n, schedule.plan(4).n) == (3, 2)


def test_the_kernels_need_transposable_2of4_and_refuse_by_name_where_they_cannot_run():
    assert SemiStructuredSparsity(kernels=True).transposable  # the kernels' mask unless told otherwise
    assert not SemiStructuredSparsity().transposable
    with pytest.raises(ValueError, match="set n=2, m=4, transposable=True"):
        SemiStructuredSparsity(kernels=True, transposable=False)
    with pytest.raises(ValueError, match="set n=2, m=4, transposable=True"):
        SemiStructuredSparsity(n=1, m=4, transposable=True, kernels=True)
    cpu, bf16 = torch.device("cpu"), torch.bfloat16

    class Conv1D(nn.Module):  # Hugging Face GPT-2's: the weight held as (in, out)
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(64, 128))

    assert "not an nn.Linear" in refusal("h.0.mlp.c_fc.weight", Conv1D(), cpu, bf16)
    assert "96 x 64: both dimensions must be multiples of 64" in refusal("fc.weight", nn.Linear(64, 96), cpu, bf16)
    assert "float32" in refusal("fc.weight", nn.Linear(64, 128), cpu, torch.float32)
    assert "device is cpu" in refusal("fc.weight", nn.Linear(64, 128), cpu, bf16)
    with pytest.raises(ValueError, match=r"device is cpu.*2 of 2 targeted layers refused, first a.*kernels=false"):
        check({"a": nn.Linear(64, 128), "b": nn.Linear(128, 64)}, cpu, bf16)


def test_the_kernels_switch_on_two_updates_after_the_final_mask_and_off_at_the_dense_finish():
    """A forward under 2BW reads the version before the last update: the kernels (which keep 2 of each 4 whatever
    the weights hold) start only once both versions are 2:4, and stop before SPDF's dense weights can reach them."""
    layer = nn.Linear(64, 128)
    callback = SemiStructuredSparsity(start_step=2, end_step=4, transposable=True, kernels=True, dense_from_step=9)
    callback._kernel_layers = {"fc.weight": layer}
    state = {}
    for step in range(11):
        callback.step = step
        callback._sync_kernels()
        state[step] = "forward" in layer.__dict__
    assert [s for s, on in state.items() if on] == [6, 7, 8]
    one_shot = SemiStructuredSparsity(transposable=True, kernels=True)  # 2:4 at step 0, before the first forward
    one_shot._kernel_layers = {"fc.weight": layer}
    one_shot._sync_kernels()
    assert "forward" in layer.__dict__
    use_kernels(layer, False)
    assert "forward" not in layer.__dict__ and layer(torch.zeros(2, 64)).shape == (2, 128)


def test_a_user_asking_for_the_kernels_on_the_cpu_is_told_at_the_start_by_layer_and_fix():
    """``Trainer.fit`` with ``kernels=True`` on a CPU stops before the first step, naming the device, the first
    layer and the key that turns them off; the same run with ``kernels=False`` trains the transposable masks."""
    from lightning_pd2bw.models import GPT, GPTConfig

    from .test_sparsity_training import SEQ, fit

    def run(kernels: bool) -> SemiStructuredSparsity:
        callback = SemiStructuredSparsity(transposable=True, kernels=kernels)
        module = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=64, block_size=SEQ), lr=1e-2)  # 64: the kernels' multiple
        fit(module, [callback], 2, precision="bf16-true")
        return callback

    with pytest.raises(ValueError, match=r"device is cpu.*first \S+attn\S*weight.*sparsity.kernels=false"):
        run(kernels=True)
    masks = run(kernels=False).sparsifier.masks
    assert masks and all(m.t().reshape(m.shape[1], -1, 4).sum(-1).eq(2).all() for m in masks.values())


def test_an_engine_level_loop_attaches_the_kernels_itself_and_is_refused_alike():
    from lightning_pd2bw.models import GPT, GPTConfig

    module = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=64, block_size=16))
    module.configure_model()
    callback = SemiStructuredSparsity(kernels=True)
    callback.sparsifier = callback.build(module)
    with pytest.raises(ValueError, match=r"float32.*sparsity.kernels=false"):
        callback.attach_kernels(module, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match=r"device is cpu"):
        callback.attach_kernels(module, torch.device("cpu"), torch.bfloat16)
