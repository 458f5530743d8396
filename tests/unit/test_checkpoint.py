"""Checkpoint files: atomic publication, the manifest, and clear errors for corrupt or foreign input."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from lightning_pd2bw import checkpoint as ckpt
from lightning_pd2bw.config import ConfigError, check_checkpoint

LAYOUT = {"num_stages": 2, "data_parallel_size": 1, "num_layers": 4, "stage_layers": [(0, 2), (2, 4)]}


def write(path, step: int = 5) -> None:
    """A two-stage checkpoint written by two threads playing the two ranks (barrier and gather between them)."""
    barrier = threading.Barrier(2)
    gathered: list = [None, None]

    def gather(stage: int, entry):
        gathered[stage] = entry
        barrier.wait()
        return list(gathered)

    def rank(stage: int) -> None:
        checkpoint = {
            "global_step": step,
            "epoch": 0,
            "state_dict": {f"layers.{stage}.w": torch.full((3,), float(step + stage))},
            "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
            "optimizer_param_names": [[f"layers.{stage}.w"]],
            "callbacks": {
                "Sparsity": {"step": step, "sparsifier": {"masks": {f"layers.{stage}.w": torch.tensor([1, 0, 0])}}}
            },
        }
        ckpt.save_sharded(
            path,
            checkpoint,
            LAYOUT,
            stage=stage,
            writes_shard=True,
            is_global_zero=stage == 0,
            barrier=lambda name: barrier.wait(),
            gather=lambda entry: gather(stage, entry),
        )

    threads = [threading.Thread(target=rank, args=(stage,)) for stage in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


@pytest.fixture
def saved(tmp_path):
    path = tmp_path / "step.ckpt"
    write(path)
    return path


def test_manifest_records_layout_files_and_sparsity(saved):
    manifest = ckpt.read_manifest(saved)
    assert manifest["global_step"] == 5 and manifest["num_stages"] == 2
    assert set(manifest["files"]) == {"stage-000.pt", "stage-001.pt", "trainer.pt"}
    assert all(len(f["sha256"]) == 64 and f["bytes"] > 0 for f in manifest["files"].values())
    assert manifest["sparsity"]["density"] == {
        "layers.0.w": pytest.approx(1 / 3, abs=1e-5),
        "layers.1.w": pytest.approx(1 / 3, abs=1e-5),
    }
    assert manifest["sparsity"]["overall_sparsity"] == pytest.approx(2 / 3, abs=1e-5)
    assert ckpt.consolidate(saved).keys() == {"layers.0.w", "layers.1.w"}
    assert not (saved.parent / "step.ckpt.tmp").exists()


def test_republishing_keeps_one_complete_checkpoint(saved):
    write(saved, step=9)
    assert ckpt.read_manifest(saved)["global_step"] == 9
    assert ckpt.consolidate(saved)["layers.1.w"][0] == 10
    assert not (saved.parent / "step.ckpt.old").exists()


def test_crash_between_the_two_renames_falls_back_to_old(saved):
    saved.rename(saved.parent / "step.ckpt.old")  # PATH -> PATH.old done, PATH.tmp -> PATH not yet
    assert ckpt.read_manifest(saved)["global_step"] == 5
    assert ckpt.consolidate(saved)["layers.0.w"][0] == 5


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda p: (p / "stage-001.pt").write_bytes((p / "stage-001.pt").read_bytes()[:-20]),
            "is corrupt: stage-001.pt",
        ),
        (lambda p: (p / "stage-001.pt").unlink(), "has no stage-001.pt; it is incomplete"),
        (lambda p: (p / "manifest.json").unlink(), "has no manifest.json: its save never finished"),
        (lambda p: (p / "manifest.json").write_text("{"), "manifest.json is corrupt"),
    ],
    ids=["truncated shard", "missing shard", "unpublished", "corrupt manifest"],
)
def test_damaged_checkpoints_name_the_cause_and_the_fix(saved, damage, message):
    damage(saved)
    with pytest.raises((ValueError, FileNotFoundError), match=message) as error:
        ckpt.consolidate(saved)
    assert "use another checkpoint" in str(error.value) or "previous checkpoint" in str(error.value)


def test_foreign_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a pd2bw checkpoint"):
        ckpt.read_manifest(tmp_path / "nothing")
    single = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {}}, single)
    with pytest.raises(ValueError, match="single-file checkpoint.*strategy='auto'"):
        ckpt.read_manifest(single)


def test_ckpt_path_is_checked_before_launch(saved, tmp_path):
    check_checkpoint(saved, 4)
    with pytest.raises(
        ConfigError, match=r"ckpt_path=.*written for a model with 4 pipeline layers; model.\* here builds 6"
    ):
        check_checkpoint(saved, 6)
    with pytest.raises(ConfigError, match="ckpt_path=.*is not a pd2bw checkpoint"):
        check_checkpoint(tmp_path / "missing", 4)


def test_reshard_gathers_by_name(saved):
    optimizer_state = {"state": {}, "param_groups": [{"lr": 0.5, "params": [0, 1]}]}
    part = ckpt.reshard(saved, {"layers.0.w", "layers.1.w"}, [[["layers.0.w"], ["layers.1.w"]]], [optimizer_state])
    assert set(part["state_dict"]) == {"layers.0.w", "layers.1.w"}
    assert part["optimizer_states"][0]["param_groups"] == [{"lr": 0.1, "params": [0, 1]}]  # saved hyper-parameters
    masks = part["callbacks"]["Sparsity"]["sparsifier"]["masks"]
    assert set(masks) == {"layers.0.w", "layers.1.w"}
    json.dumps(ckpt.read_manifest(saved))


def test_not_mistaken_for_a_lightning_sharded_checkpoint_and_old_name_still_read(saved):
    """Lightning's consolidate_checkpoint recognises its own sharded checkpoints by a ``meta.pt`` file: ours has
    none. A checkpoint written under the old name (``meta.pt`` in its manifest) still loads."""
    assert not (saved / "meta.pt").exists()
    step = ckpt.read_meta(saved)["pd2bw"]["global_step"]
    manifest = json.loads((saved / ckpt.MANIFEST).read_text())
    manifest["files"]["meta.pt"] = manifest["files"].pop("trainer.pt")
    (saved / "trainer.pt").rename(saved / "meta.pt")
    (saved / ckpt.MANIFEST).write_text(json.dumps(manifest))
    assert ckpt.read_meta(saved)["pd2bw"]["global_step"] == step
