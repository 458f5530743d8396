"""Sharded checkpoints: one file per pipeline stage plus Lightning's metadata, published atomically.

Layout of a checkpoint ``PATH`` (a directory, so ``ModelCheckpoint``'s ``*.ckpt`` names work)::

    PATH/meta.pt          Lightning's loops, schedulers, hparams ... and the pd2bw layout
    PATH/stage-000.pt     stage 0: its state_dict entries, optimizer state, callback states
    PATH/stage-001.pt     ...

All shards are written to ``PATH.tmp`` first; once every stage has written, global rank 0 swaps the
directory into place, so a crash during a save leaves the previous checkpoint intact.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

META_FILE = "meta.pt"
SHARD_KEYS = ("state_dict", "optimizer_states", "callbacks")


def shard_file(path: str | Path, stage: int) -> Path:
    return Path(path) / f"stage-{stage:03d}.pt"


def write_shard(tmp: Path, stage: int, checkpoint: dict[str, Any]) -> None:
    torch.save({k: checkpoint[k] for k in SHARD_KEYS if k in checkpoint}, shard_file(tmp, stage))


def write_meta(tmp: Path, checkpoint: dict[str, Any], layout: dict[str, Any]) -> None:
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    meta["pd2bw"] = layout
    torch.save(meta, tmp / META_FILE)


def save_sharded(
    path: Path,
    checkpoint: dict[str, Any],
    layout: dict[str, Any],
    *,
    stage: int,
    writes_shard: bool,
    is_global_zero: bool,
    barrier: Callable[[str], None],
) -> None:
    """Collective save: every stage of replica 0 writes its shard into ``PATH.tmp``, rank 0 the
    metadata; once all have written, rank 0 publishes. A crash before that leaves ``PATH`` untouched."""
    tmp = path.with_name(path.name + ".tmp")
    if is_global_zero:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    barrier("pd2bw_save_begin")
    if writes_shard:
        write_shard(tmp, stage, checkpoint)
    if is_global_zero:
        write_meta(tmp, checkpoint, layout)
    barrier("pd2bw_save_written")
    if is_global_zero:
        publish(tmp, path)
    barrier("pd2bw_save_published")


def check_layout(path: str | Path, saved: dict[str, Any], num_stages: int, stage_layers: list[range]) -> None:
    """Resuming needs the same depth and layer split (resharding is a separate step)."""
    layers = [(r.start, r.stop) for r in stage_layers]
    if saved["num_stages"] != num_stages or [tuple(x) for x in saved["stage_layers"]] != layers:
        raise ValueError(
            f"checkpoint {str(path)!r} was written with num_stages={saved['num_stages']} and stage layers "
            f"{saved['stage_layers']}; this run has num_stages={num_stages} and {layers}. Resume with the same "
            "num_stages, or consolidate(path) the checkpoint and load the full state dict"
        )


def publish(tmp: Path, path: Path) -> None:
    """Swap ``tmp`` into ``path``; the old checkpoint is removed only after the new one is in place."""
    old = path.with_name(path.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    if old.exists():
        shutil.rmtree(old)


def read_meta(path: str | Path) -> dict[str, Any]:
    meta_path = Path(path) / META_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(
            f"{str(path)!r} is not a pd2bw checkpoint (no {META_FILE}); pass a directory written by "
            "strategy='pd2bw' (e.g. from ModelCheckpoint), or load a plain checkpoint with strategy='auto'"
        )
    return torch.load(meta_path, map_location="cpu", weights_only=False)


def read_stage(path: str | Path, stage: int, map_location: Any = "cpu") -> dict[str, Any]:
    file = shard_file(path, stage)
    if not file.is_file():
        raise FileNotFoundError(
            f"checkpoint {str(path)!r} has no shard for stage {stage} ({file.name}); it is incomplete"
        )
    return torch.load(file, map_location=map_location, weights_only=False)


def consolidate(path: str | Path) -> dict[str, torch.Tensor]:
    """The full model's state dict from a sharded checkpoint; loads into the plain module."""
    layout = read_meta(path)["pd2bw"]
    state: dict[str, torch.Tensor] = {}
    for stage in range(layout["num_stages"]):
        state.update(read_stage(path, stage)["state_dict"])
    return state
