"""Checkpoint files: DCP entries written by two real ranks (gloo), atomic publication, the manifest, reading only
a stage's own bytes, and clear errors for corrupt or foreign input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemReader

from lightning_pd2bw.checkpoint import store as ckpt
from lightning_pd2bw.checkpoint.entries import BY_PARAMETER
from lightning_pd2bw.cli.checks import ConfigError, check_checkpoint
from lightning_pd2bw.cli.consolidate import main as consolidate_main

LAYOUT = {"num_stages": 2, "data_parallel_size": 1, "num_layers": 4, "stage_layers": [(0, 2), (2, 4)]}
REPLICAS = {"num_stages": 1, "data_parallel_size": 2, "num_layers": 4, "stage_layers": [(0, 4)]}


def stage_checkpoint(stage: int, step: int) -> dict:
    return {
        "global_step": step,
        "epoch": 0,
        "state_dict": {f"layers.{stage}.w": torch.full((3,), float(step + stage))},
        "optimizer_states": [
            {
                "state": {0: {"exp_avg": torch.full((3,), -float(stage)), "step": torch.tensor(float(step))}},
                "param_groups": [{"lr": 0.1, "params": [0]}],
            }
        ],
        "optimizer_param_names": [[[f"layers.{stage}.w"]]],  # per optimizer, per parameter: its names
        "callbacks": {
            # the sparsity callback's state: its masks through the per-parameter protocol
            "Sparsity": {
                "step": step,
                "sparsifier": {BY_PARAMETER: {"masks": {f"layers.{stage}.w": torch.tensor([1, 0, 0])}}},
            },
            # any callback's per-parameter state, through the protocol: tensors become entries, other values stay
            "Ema": {
                "decay": 0.9,
                BY_PARAMETER: {
                    "ema": {f"layers.{stage}.w": torch.full((3,), 100.0 + stage)},
                    "scale": {f"layers.{stage}.w": 0.5 + stage},
                },
            },
        },
    }


def _rank(rank: int, folder: str, saves: list[tuple[str, int, bool, bool]]) -> None:
    """One of two ranks: each save as ``(path, step, asynchronous, replicas)``; the ranks are the two stages of one
    pipeline, or (``replicas``) two replicas of a one-stage pipeline, holding the same entries."""
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    own_group = dist.new_group(backend="gloo")  # an asynchronous save's collectives run beside training's

    def gather(obj):
        out = [None, None]
        dist.all_gather_object(out, obj)
        return out

    for path, step, asynchronous, replicas in saves:
        stage = 0 if replicas else rank
        pending = ckpt.save_sharded(
            ckpt.Path(path),
            stage_checkpoint(stage, step),
            REPLICAS if replicas else LAYOUT,
            stage=stage,
            is_global_zero=rank == 0,
            barrier=lambda name: dist.barrier(),
            gather=gather,
            process_group=own_group if asynchronous else None,
            asynchronous=asynchronous,
        )
        if pending is not None:
            pending.result()
        dist.barrier()
    dist.destroy_process_group()


def write(folder, saves) -> None:
    mp.spawn(_rank, args=(str(folder), [(str(p), *rest) for p, *rest in saves]), nprocs=2)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Written once by two processes: ``step.ckpt`` (step 5), ``again.ckpt`` (step 5, then 9 over it),
    ``async.ckpt`` (step 7, asynchronous) and ``replicas.ckpt`` (two replicas of one stage)."""
    folder = tmp_path_factory.mktemp("written")
    saves = [("step.ckpt", 5, False, False), ("again.ckpt", 5, False, False), ("again.ckpt", 9, False, False)]
    saves += [("async.ckpt", 7, True, False), ("replicas.ckpt", 5, False, True)]
    write(folder, [(folder / name, *rest) for name, *rest in saves])
    return folder


@pytest.fixture
def saved(written, tmp_path):
    path = tmp_path / "step.ckpt"
    shutil.copytree(written / "step.ckpt", path)
    return path


def test_manifest_records_layout_files_and_sparsity(saved):
    manifest = ckpt.read_manifest(saved)
    assert manifest["global_step"] == 5 and manifest["num_stages"] == 2
    assert set(manifest["files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp", "trainer.pt"}  # DCP's, ours
    assert all(f["bytes"] > 0 for f in manifest["files"].values())
    assert manifest["sparsity"]["density"] == {
        "layers.0.w": pytest.approx(1 / 3, abs=1e-5),
        "layers.1.w": pytest.approx(1 / 3, abs=1e-5),
    }
    assert manifest["sparsity"]["overall_sparsity"] == pytest.approx(2 / 3, abs=1e-5)
    assert ckpt.consolidate(saved).keys() == {"layers.0.w", "layers.1.w"}
    assert not (saved.parent / "step.ckpt.tmp").exists()


def test_republishing_keeps_one_complete_checkpoint(written):
    again = written / "again.ckpt"
    assert ckpt.read_manifest(again)["global_step"] == 9
    assert ckpt.consolidate(again)["layers.1.w"][0] == 10
    assert not (written / "again.ckpt.old").exists() and not (written / "again.ckpt.tmp").exists()


def test_asynchronous_save_is_published_complete(written):
    path = written / "async.ckpt"
    assert ckpt.read_manifest(path)["global_step"] == 7
    assert_weights(ckpt.consolidate(path), 7.0, 8.0)


def test_replicas_are_written_once_and_share_the_writing(written):
    """Two replicas give DCP the same entries: each is written once, and both ranks write part of them."""
    one_writer = (written / "step.ckpt" / "__0_0.distcp").stat().st_size  # stage 0's entries, from one rank
    files = {f.name: f.stat().st_size for f in (written / "replicas.ckpt").glob("*.distcp")}
    assert set(files) == {"__0_0.distcp", "__1_0.distcp"} and min(files.values()) > 0, files
    assert sum(files.values()) == one_writer, files
    assert_weights({"layers.1.w": torch.full((3,), 6.0), **ckpt.consolidate(written / "replicas.ckpt")}, 5.0, 6.0)


def test_crash_between_the_two_renames_falls_back_to_old(saved):
    saved.rename(saved.parent / "step.ckpt.old")  # PATH -> PATH.old done, PATH.tmp -> PATH not yet
    assert ckpt.read_manifest(saved)["global_step"] == 5
    assert ckpt.consolidate(saved)["layers.0.w"][0] == 5


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda p: (p / "__1_0.distcp").write_bytes((p / "__1_0.distcp").read_bytes()[:-20]),
            "is corrupt: __1_0.distcp has",
        ),
        (lambda p: (p / "__1_0.distcp").unlink(), "has no __1_0.distcp; it is incomplete"),
        (lambda p: (p / "manifest.json").unlink(), "has no manifest.json: its save never finished"),
        (lambda p: (p / "manifest.json").write_text("{"), "manifest.json is damaged"),
    ],
    ids=["truncated shard", "missing shard", "unpublished", "corrupt manifest"],
)
def test_damaged_checkpoints_name_the_cause_and_the_fix(saved, damage, message):
    damage(saved)
    with pytest.raises((ValueError, FileNotFoundError), match=message) as error:
        ckpt.consolidate(saved)
    assert "use another checkpoint" in str(error.value) or "previous checkpoint" in str(error.value)


def test_foreign_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ckpt.read_manifest(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="is not a pd2bw checkpoint"):
        ckpt.read_manifest(tmp_path / "empty")
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
    with pytest.raises(ConfigError, match="ckpt_path=.*does not exist"):
        check_checkpoint(tmp_path / "missing", 4)


def assert_weights(state: dict, first: float, second: float) -> None:
    assert set(state) == {"layers.0.w", "layers.1.w"}
    assert torch.equal(state["layers.0.w"], torch.full((3,), first))
    assert torch.equal(state["layers.1.w"], torch.full((3,), second))


def load_whole_model_as_one_stage(path) -> dict:
    model = {"layers.0.w": torch.zeros(3), "layers.1.w": torch.zeros(3)}
    fresh = {"state": {}, "param_groups": [{"lr": 0.5, "params": [0, 1]}]}
    return ckpt.load_stage(
        path, stage=0, stage_layers=[range(0, 4)], model=model, names=[[["layers.0.w"], ["layers.1.w"]]], fresh=[fresh]
    ) | {"model": model}


def test_reshard_gathers_by_name(saved):
    part = load_whole_model_as_one_stage(saved)
    assert_weights(part["model"], 5.0, 6.0)  # read in place
    assert all(part["state_dict"][k].data_ptr() == part["model"][k].data_ptr() for k in part["model"])
    optimizer = part["optimizer_states"][0]
    assert optimizer["param_groups"] == [{"lr": 0.1, "params": [0, 1]}]  # saved hyper-parameters, this run's indices
    assert torch.equal(optimizer["state"][1]["exp_avg"], torch.full((3,), -1.0))
    assert optimizer["state"][0]["step"].device.type == "cpu" and optimizer["state"][0]["step"] == 5
    masks = part["callbacks"]["Sparsity"]["sparsifier"][BY_PARAMETER]["masks"]
    assert set(masks) == {"layers.0.w", "layers.1.w"} and torch.equal(masks["layers.1.w"], torch.tensor([1, 0, 0]))
    ema = part["callbacks"]["Ema"]
    assert ema["decay"] == 0.9 and ema[BY_PARAMETER]["scale"] == {"layers.0.w": 0.5, "layers.1.w": 1.5}
    assert torch.equal(ema[BY_PARAMETER]["ema"]["layers.1.w"], torch.full((3,), 101.0))
    json.dumps(ckpt.read_manifest(saved))


def test_a_stage_reads_only_its_own_bytes(saved):
    """Stage 1's entries (tensors, optimizer groups, callback states) are overwritten with zeros of the same length:
    stage 0 still loads exactly (it never reads them, nor checks the file that holds them); stage 1 is refused by its
    file's checksum, naming the file."""
    metadata = FileSystemReader(saved).read_metadata()
    for index, info in metadata.storage_data.items():
        if "layers.1.w" in index.fqn or index.fqn.endswith("stage-1"):  # its tensors, groups, callback states
            with open(saved / info.relative_path, "r+b") as handle:
                handle.seek(info.offset)
                handle.write(bytes(info.length))

    def load(stage: int) -> dict:
        model = {f"layers.{stage}.w": torch.zeros(3)}
        fresh = {"state": {}, "param_groups": [{"lr": 0.5, "params": [0]}]}
        names = [[[f"layers.{stage}.w"]]]
        return ckpt.load_stage(
            saved, stage=stage, stage_layers=[range(0, 2), range(2, 4)], model=model, names=names, fresh=[fresh]
        )

    own = load(0)
    assert torch.equal(own["state_dict"]["layers.0.w"], torch.full((3,), 5.0))
    assert list(own["callbacks"]["Ema"][BY_PARAMETER]["ema"]) == ["layers.0.w"]  # a callback's tensors: its own only
    assert torch.equal(own["optimizer_states"][0]["state"][0]["exp_avg"], torch.zeros(3))  # -0.0: stage 0's value
    with pytest.raises(ckpt.UnreadableCheckpoint, match=r"is damaged: __1_0.distcp's bytes changed"):
        load(1)


def test_every_file_carries_the_checksum_of_the_bytes_written(saved):
    """Issue 98: the manifest records each file's CRC32C, taken while DCP wrote it (the ranks' sidecars folded in
    and removed): it equals a fresh read of the file."""
    from lightning_pd2bw.checkpoint.checksums import SIDECAR, file_crc32c

    files = ckpt.read_manifest(saved)["files"]
    assert {name: entry["crc32c"] for name, entry in files.items()} == {
        name: file_crc32c(saved / name) for name in files
    }
    assert not list(saved.glob(f"*{SIDECAR}"))


@pytest.mark.parametrize("name", ["__0_0.distcp", "__1_0.distcp", ".metadata", "trainer.pt"])
def test_flipped_bytes_are_refused_by_name(saved, name):
    """Issue 98: 48 bytes flipped inside a file (its size unchanged) are refused naming the file, by
    ``consolidate`` and by a stage's load, where they used to load without complaint."""
    data = bytearray((saved / name).read_bytes())
    middle = len(data) // 2
    data[middle : middle + 48] = bytes(b ^ 0xFF for b in data[middle : middle + 48])
    (saved / name).write_bytes(bytes(data))
    with pytest.raises(ckpt.UnreadableCheckpoint, match=f"is damaged: {name}'s bytes changed"):
        ckpt.consolidate(saved) if name != "trainer.pt" else ckpt.read_meta(saved)


def test_not_mistaken_for_a_lightning_sharded_checkpoint(saved):
    """Lightning's consolidate_checkpoint recognises its own sharded checkpoints by a ``meta.pt`` file: ours has
    none."""
    assert not (saved / "meta.pt").exists() and (saved / ckpt.META_FILE).exists()


def test_an_unreadable_newest_checkpoint_is_refused_by_name_never_passed_over(tmp_path, saved):
    """``ckpt_path="last"`` (``newest_checkpoint``) names a published checkpoint it cannot read (a damaged manifest,
    or a format-1 checkpoint of 0.1.0's first days) instead of resuming from an older one, or from step 0 when it
    is the only one. An unpublished save (no manifest: killed mid-save) is still passed over."""
    import shutil

    from lightning_pd2bw.checkpoint.finding import newest_checkpoint

    folder = tmp_path / "run"
    folder.mkdir()
    shutil.copytree(saved, folder / "step=2.ckpt")
    shutil.copytree(saved, folder / "step=4.ckpt")
    manifest = json.loads((folder / "step=4.ckpt" / ckpt.MANIFEST).read_text())
    (folder / "step=4.ckpt" / ckpt.MANIFEST).write_text(json.dumps({**manifest, "global_step": 99}))
    (folder / "step=6.ckpt").mkdir()  # killed mid-save: files, no manifest
    (folder / "step=6.ckpt" / ckpt.META_FILE).write_bytes(b"partial")
    assert newest_checkpoint(folder).name == "step=4.ckpt"
    (folder / "step=4.ckpt" / ckpt.MANIFEST).write_text('{"format": 2, "glob')
    with pytest.raises(ckpt.UnreadableCheckpoint, match=r"step=4.ckpt.*manifest.json is damaged.*not resumed"):
        newest_checkpoint(folder)
    (folder / "step=4.ckpt" / ckpt.MANIFEST).write_text(json.dumps({**manifest, "format": 1}))
    with pytest.raises(ckpt.UnreadableCheckpoint, match=r"format 1 .*lightning_pd2bw 0.1.x.*reads format 2"):
        newest_checkpoint(folder)


def test_the_per_parameter_protocol_refuses_mixed_entries():
    from lightning_pd2bw.checkpoint.entries import split_by_parameter

    with pytest.raises(ValueError, match=r"by_parameter\['ema'\] mixes tensors and other values"):
        split_by_parameter({BY_PARAMETER: {"ema": {"a.w": torch.ones(1), "b.w": 1.0}}})
    with pytest.raises(ValueError, match=r"by_parameter\['model'\]: the entry may not be"):
        split_by_parameter({BY_PARAMETER: {"model": {"a.w": torch.ones(1)}}})


class Payload:
    """What an attacker puts in a pickle: unpickling it calls ``Path.touch`` on a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _replace_file(checkpoint: Path, name: str, data: bytes) -> None:
    """Write ``name``, its size and its checksum into the manifest, as an attacker who rewrote the checkpoint
    would."""
    from lightning_pd2bw.checkpoint.checksums import file_crc32c

    (checkpoint / name).write_bytes(data)
    manifest = json.loads((checkpoint / ckpt.MANIFEST).read_text())
    manifest["files"][name].update(bytes=len(data), crc32c=file_crc32c(checkpoint / name))
    (checkpoint / ckpt.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("target", ["trainer.pt", ".metadata"])
def test_loading_a_checkpoint_never_runs_code_from_it(saved, tmp_path, target):
    """Issue 48: a crafted pickle in ``trainer.pt`` (Lightning's part) or in DCP's ``.metadata`` is refused, naming
    the file and what it asked for, by every reader (resume, consolidate, the masks); the payload never runs."""
    import io
    import pickle

    from lightning_pd2bw.sparsity.export import checkpoint_masks

    marker = tmp_path / "ran"
    if target == "trainer.pt":
        buffer = io.BytesIO()
        torch.save({"global_step": 5, "hyper_parameters": Payload(marker)}, buffer)
        data = buffer.getvalue()
    else:
        data = pickle.dumps(Payload(marker))
    _replace_file(saved, target, data)
    readers = []
    if target == "trainer.pt":  # resume and consolidate read Lightning's part; the run's checks before launch too
        readers += [lambda: ckpt.read_meta(saved), lambda: check_checkpoint(saved, 4)]
    else:  # every reader of the entries reads DCP's index first
        readers += [lambda: load_whole_model_as_one_stage(saved), lambda: checkpoint_masks(saved)]
    for read in readers:
        with pytest.raises(ValueError, match=f"{target}.* refused"):
            read()
    with pytest.raises(SystemExit, match=f"^pd2bw-consolidate: .*{target}.* refused") as ended:  # the message alone
        consolidate_main([str(saved), str(tmp_path / "out.ckpt")])
    assert isinstance(ended.value.__cause__, type(None)), "no traceback: the refusal's message is the whole story"
    assert not marker.exists(), "the payload ran"


def test_byte_entries_load_without_running_code(tmp_path):
    """The entries DCP stores as bytes (optimizer groups, callback states) load with weights_only=True too."""
    from lightning_pd2bw.checkpoint.store import _load, write_state

    marker = tmp_path / "ran"
    folder = tmp_path / "entries"
    folder.mkdir()
    write_state(folder, {"callbacks/stage-0": {"payload": Payload(marker)}, "optim_groups/0/stage-0": [{"lr": 0.1}]})
    assert not marker.exists()
    safe = {"optim_groups/0/stage-0": None}
    _load(folder, safe)
    assert safe["optim_groups/0/stage-0"] == [{"lr": 0.1}]
    with pytest.raises(ckpt.UnreadableCheckpoint, match="entry 'callbacks/stage-0' cannot be read: refused"):
        _load(folder, {"callbacks/stage-0": None})
    assert not marker.exists(), "the payload ran"


def test_a_save_that_cannot_fit_is_refused_before_writing(tmp_path, monkeypatch):
    """Issue 48, disk full: every rank learns before anything is written that the save does not fit, with the
    folder, what it needs and what is free (each stage's bytes once: a replica's copy is not written twice)."""
    import errno
    from collections import namedtuple

    entries = {"model/w": torch.zeros(1 << 18), "optim_groups/0/stage-0": [{"lr": 0.1}]}  # 1 MiB of tensors
    gathered = [(0, {"model/w": 1 << 20}), (1, {"model/v": 1 << 20}), (0, {"model/w": 1 << 20})]  # stages 0, 1 and
    # a replica of stage 0: 2 MiB to write
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: usage(1 << 30, 0, 3 << 20))
    ckpt.check_space(tmp_path / "step.ckpt.tmp", 0, entries, lambda own: gathered)  # fits: nothing raised
    monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: usage(1 << 30, 0, 2 << 20))
    with pytest.raises(OSError, match=r"No space left .*step.ckpt'.* needs about 2.1 MiB and 2.0 MiB are free") as e:
        ckpt.check_space(tmp_path / "step.ckpt.tmp", 0, entries, lambda own: gathered)
    assert e.value.errno == errno.ENOSPC and "previous checkpoint is intact" in str(e.value)
    # replicas that each write their own share (the sharded float32 master and optimizer): the shares add up
    sharded = [(0, {"model/a": 1 << 20}), (0, {"model/b": 1 << 20})]
    with pytest.raises(OSError, match=r"needs about 2.1 MiB"):
        ckpt.check_space(tmp_path / "step.ckpt.tmp", 0, entries, lambda own: sharded)


@pytest.mark.parametrize(
    "failure",
    [
        RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),  # torch.save, disk full
        OSError(28, "No space left on device"),
    ],
)
def test_a_disk_that_fills_during_a_save_is_named(tmp_path, failure):
    """Issue 48, disk full mid-write (the space check passed, then the device filled): the error says no space is
    left, where and how much is free, instead of torch.save's ``unexpected pos``; other failures pass unchanged."""
    import errno

    tmp = tmp_path / "epoch=0-step=3.ckpt.tmp"
    tmp.mkdir()
    with pytest.raises(OSError, match=r"No space left on the device while writing checkpoint .*MiB free") as e:
        with ckpt.out_of_space_named(tmp):
            raise failure
    assert e.value.errno == errno.ENOSPC and e.value.__cause__ is failure
    with pytest.raises(ValueError, match="another failure"):
        with ckpt.out_of_space_named(tmp):
            raise ValueError("another failure")
