"""Sparsity under pd2bw over real processes: stage-local masks, a global threshold across stages, masks
applied from the next weight version in 2BW, identical masks on data-parallel replicas, exact resume.

The weights themselves are compared with the single-process reference in test_equivalence.py (the
sparse cases are in CASES); here: the masks, their zeros, and the sparsity trajectory."""

from __future__ import annotations

import json

import pytest
import torch

from .cases import CASES
from .reference import reference_run
from .test_equivalence import merged

SPARSE = [n for n in CASES if CASES[n].sparsity]


def rank_masks(folder, rank: int, prefix: str = "") -> dict[str, torch.Tensor]:
    return torch.load(folder / f"{prefix}masks-rank-{rank}.pt", weights_only=True)


def pipeline_masks(folder, case, prefix: str = "") -> dict[str, torch.Tensor]:
    masks: dict[str, torch.Tensor] = {}
    for stage in range(case.num_stages):  # replica 0 holds ranks 0..d-1
        part = rank_masks(folder, stage, prefix)
        assert not set(part) & set(masks), "each stage masks only its own layers"
        masks.update(part)
    return masks


@pytest.mark.parametrize("name", SPARSE)
def test_masks_match_single_process_reference(trained, name):
    case = CASES[name]
    _, expected = reference_run(case, case.width)
    got = pipeline_masks(trained[name], case)
    assert set(got) == set(expected)
    for key in expected:
        assert torch.equal(got[key], expected[key]), f"{name} {key}: mask differs from the reference"
    weights = merged(trained[name])
    for key, mask in got.items():
        assert torch.count_nonzero(weights[key][~mask]) == 0, f"{name} {key}: a masked weight is not zero"
    if case.sparsity not in ("spdf", "dense_right_after_pruning"):
        kept = sum(int(m.sum()) for m in got.values()) / sum(m.numel() for m in got.values())
        assert kept < 0.7, "the run ended sparse"
    else:
        assert not got, "sparse-to-dense removed every mask"


@pytest.mark.parametrize("name", ["gpt_2bw_d2w2_sparse_static", "gpt_2bw_d2w2_bf16_gmp"])
def test_replicas_hold_identical_masks(trained, name):
    """Random masks, and magnitude masks where only each weight's owner keeps its float32 master (bf16 versions):
    every replica decides from the same values (``Sparsifier.score_dtype``)."""
    case = CASES[name]
    for stage in range(case.num_stages):
        first, second = rank_masks(trained[name], stage), rank_masks(trained[name], case.num_stages + stage)
        assert first.keys() == second.keys() and first
        for key in first:
            assert torch.equal(first[key], second[key]), f"replicas disagree on {key}"


def test_global_threshold_spans_stages(trained):
    """One threshold over the whole model: per-layer densities differ, the total is the target."""
    case = CASES["gpt_2bw_sparse_gmp_global"]
    masks = pipeline_masks(trained[case.name], case)
    densities = [m.float().mean().item() for m in masks.values()]
    total = sum(int(m.sum()) for m in masks.values()) / sum(m.numel() for m in masks.values())
    assert abs(total - 0.4) < 1e-3
    assert max(densities) - min(densities) > 0.02, "a global threshold gives layers different densities"


def test_resume_continues_the_sparsity_trajectory(trained):
    name = "gpt_2bw_sparse_resume"
    case, folder = CASES[name], trained[name]
    for rank in range(case.num_stages):
        full = json.loads((folder / f"trajectory-rank-{rank}.json").read_text())
        resumed = json.loads((folder / f"resumed-trajectory-rank-{rank}.json").read_text())
        assert resumed == full[-len(resumed) :] and len(resumed) == case.steps - case.checkpoint_every
        assert len({round(p[2], 6) for p in full}) > 2, "the target density moved during the run"
    for key, mask in pipeline_masks(folder, case).items():
        assert torch.equal(pipeline_masks(folder, case, "resumed-")[key], mask)


def test_sharded_checkpoint_exports_a_plain_sparse_model(trained):
    """checkpoint_masks gathers every stage's masks from a pd2bw checkpoint; folded into the consolidated
    weights they load into the plain module with the same zeros and no hooks."""
    from lightning_pd2bw.checkpoint import consolidate
    from lightning_pd2bw.sparsity import checkpoint_masks, fold_masks

    from .cases import build_model

    case = CASES["gpt_2bw_sparse_resume"]
    checkpoint = sorted((trained[case.name] / "checkpoints").glob("*step=3.ckpt"))[0]
    masks = checkpoint_masks(checkpoint)
    assert len(masks) == 12  # 3 blocks x (qkv, proj, fc, fc_proj) over both stages
    model = build_model(case)
    model.configure_model()
    model.load_state_dict(consolidate(checkpoint))
    assert fold_masks(model, masks) == sum(int((~m).sum()) for m in masks.values())
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


def test_ddp_replicas_hold_identical_masks_and_zeros(tmp_path):
    """RigL under Lightning's own DDP strategy: growth uses the all-reduced gradients, so both ranks
    choose the same connections; masked weights are zero on both."""
    from pathlib import Path

    from .launch import torchrun_script

    torchrun_script(Path(__file__).with_name("run_ddp_sparsity.py"), [str(tmp_path)], 2, timeout=300)
    first, second = (torch.load(tmp_path / f"ddp-rank-{r}.pt", weights_only=True) for r in (0, 1))
    assert first["step"] == second["step"] == 6 and first["masks"]
    for name, mask in first["masks"].items():
        assert torch.equal(second["masks"][name], mask)
        assert torch.count_nonzero(first["weights"][name][~mask]) == 0
        assert 0.2 < mask.float().mean() < 0.8


def test_rigl_is_refused_with_sharded_gradients(tmp_path):
    """RigL grows by gradient, and with ``shard_gradients=True`` a replica holds its own parameters' gradients
    only: every rank refuses at the start of training, naming the option (nothing hangs)."""
    from pathlib import Path

    from .launch import torchrun_script

    torchrun_script(Path(__file__).with_name("run_ddp_sparsity.py"), [str(tmp_path), "sharded"], 2, timeout=300)
    for rank in (0, 1):
        message = (tmp_path / f"refused-rank-{rank}.txt").read_text()
        assert "RigL grows connections by gradient" in message and "shard_gradients=False" in message


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n].sparsity])
def test_masks_zero_weights_and_every_optimizers_state(trained, name):
    """Pruned entries stay zero in the weights and in every optimizer's state (Muon's momentum, AdamW's moments)."""
    case = CASES[name]
    for rank in range(case.world):
        counters = json.loads((trained[name] / f"rank-{rank}.json").read_text())
        assert counters["masked_state_nonzero"] == 0
