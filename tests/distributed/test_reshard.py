"""Resharding: a checkpoint written at one depth x width resumes at another with identical weights,
optimizer state, sparsity masks and schedule; ``consolidate`` exports one file for the plain module."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from lightning_pd2bw.checkpoint import consolidate, read_entries, read_manifest, read_meta

from .launch import ROOT, torchrun_script
from .reference import reference_weights
from .run_reshard import CASE, SAVE_STEPS

RUNNER = ROOT / "tests" / "distributed" / "run_reshard.py"
LAYOUTS = {"4x1->2x1": (4, 4, 2, 2), "2x2->2x1": (4, 2, 2, 2)}  # save world, save depth, load world, load depth


@pytest.fixture(scope="module")
def resharded(tmp_path_factory) -> dict:
    """Two jobs: one saves at both 4-rank layouts (one Trainer after the other), one loads both at 2 ranks."""
    root = tmp_path_factory.mktemp("reshard")
    folders = {name: root / name.replace(">", "") for name in LAYOUTS}
    for phase, world_at, depth_at in (("save", 0, 1), ("load", 2, 3)):
        (world,) = {layout[world_at] for layout in LAYOUTS.values()}  # the layouts of one job share its world
        runs = [f"{folders[name]}:{layout[depth_at]}" for name, layout in LAYOUTS.items()]
        torchrun_script(RUNNER, [phase, *runs], world)
    return folders


def loaded(folder) -> dict:
    parts = [torch.load(f, weights_only=False) for f in sorted(folder.glob("loaded-rank-*.pt"))]
    return {k: {n: v for p in parts for n, v in p[k].items()} for k in ("weights", "optimizer", "masks")} | {
        "lr": parts[0]["lr"]
    }


def saved_masks(path) -> dict:
    return {name[len("masks/") :]: mask for name, mask in read_entries(path, "masks/").items()}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_resharded_state_is_identical(resharded, name):
    folder = resharded[name]
    path = next((folder / "ckpt").glob(f"*step={SAVE_STEPS}.ckpt"))
    manifest = read_manifest(path)
    _, save_depth, _, load_depth = LAYOUTS[name]
    assert manifest["num_stages"] == save_depth and manifest["global_step"] == SAVE_STEPS
    got = loaded(folder)
    weights = consolidate(path)
    assert set(got["weights"]) == set(weights)
    for key, value in weights.items():
        torch.testing.assert_close(got["weights"][key], value, rtol=0, atol=0)
    saved_optim = {}
    for file in folder.glob("saved-optim-rank-*.pt"):  # with replicas, each rank holds its shard
        saved_optim.update(torch.load(file, weights_only=False))
    assert set(got["optimizer"]) == set(saved_optim) and saved_optim
    assert {key.split(":")[0] for key in saved_optim} == {"0", "1"}  # both optimizers hold state
    for param, state in saved_optim.items():
        assert set(got["optimizer"][param]) == set(state), param
        for key, value in state.items():
            torch.testing.assert_close(got["optimizer"][param][key], value, rtol=0, atol=0)
    masks = saved_masks(path)
    assert masks and set(got["masks"]) == set(masks)
    for key, mask in masks.items():
        assert torch.equal(got["masks"][key].cpu(), mask.cpu()), key
    schedules = read_meta(path)["lr_schedulers"]
    assert len(schedules) == len(got["lr"]) == 2  # Muon's and AdamW's
    for schedule, lrs in zip(schedules, got["lr"]):
        assert schedule["last_epoch"] == SAVE_STEPS and lrs == schedule["_last_lr"]  # restored, not restarted


def test_depth_change_then_training_equals_single_process(resharded):
    """Flush is layout-independent: 3 steps at 4x1, 3 more at 2x1 = 6 steps of the single-process reference
    (same width, so the restored data position continues the same sample order)."""
    folder = resharded["4x1->2x1"]
    final = {}
    for file in folder.glob("final-stage-*.pt"):
        final.update(torch.load(file, weights_only=True))
    expected = reference_weights(replace(CASE, num_stages=2), 1)
    rtol, atol = (1e-3, 1e-3) if CASE.bf16_update else (1e-5, 1e-6)  # Muon: see Case.bf16_update
    for key, value in expected.items():
        torch.testing.assert_close(final[key], value, rtol=rtol, atol=atol, msg=lambda m, k=key: f"{k}: {m}")


def test_consolidate_exports_one_file_for_the_plain_module(resharded, tmp_path):
    from .cases import build_model

    path = next((resharded["2x2->2x1"] / "ckpt").glob(f"*step={SAVE_STEPS}.ckpt"))
    out = tmp_path / "model.ckpt"
    done = subprocess.run(
        [sys.executable, "-m", "lightning_pd2bw.cli.consolidate", str(path), str(out)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "2 stages x 2 replicas at step 3 -> one file" in done.stdout
    single = torch.load(out, weights_only=False)
    model = build_model(CASE)
    model.configure_model()
    model.load_state_dict(single["state_dict"])  # strict: every key of the plain, non-pipelined module
    assert single["global_step"] == SAVE_STEPS
