"""Sharded checkpoints: one file per pipeline stage, Lightning's metadata and a manifest, published atomically.

Layout of a checkpoint ``PATH`` (a directory, so ``ModelCheckpoint``'s ``*.ckpt`` names work)::

    PATH/manifest.json    written last: step, layout, weight-version state, data position, sparsity,
                          and every file's size and sha256 (a checkpoint without it was never published)
    PATH/trainer.pt       Lightning's loops, schedulers, hparams ... (written as meta.pt before; still read.
                          Not "meta.pt": that name makes Lightning's consolidate_checkpoint take the
                          directory for one of its own sharded checkpoints, and fail)
    PATH/stage-000.pt     stage 0: its state_dict entries, optimizer state (with parameter names),
                          callback states
    PATH/stage-001.pt     ...

Every file is written to ``PATH.tmp`` and fsynced; once all stages have written, global rank 0 writes
the manifest and swaps the directory into place (``PATH`` -> ``PATH.old``, ``PATH.tmp`` -> ``PATH``,
remove ``PATH.old``). A crash at any point leaves a complete previous checkpoint: ``PATH`` itself, or
``PATH.old`` during the two renames, which ``resolve`` then uses.

A checkpoint written at one depth x width loads at another (``reshard``): parameters, optimizer
state and sparsity masks are keyed by parameter name, so each new stage gathers its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

META_FILE = "trainer.pt"
LEGACY_META_FILE = "meta.pt"  # checkpoints written before this name changed
MANIFEST = "manifest.json"
FORMAT = 1
SHARD_KEYS = ("state_dict", "optimizer_states", "optimizer_param_names", "callbacks")


def shard_name(stage: int) -> str:
    return f"stage-{stage:03d}.pt"


def shard_file(path: str | Path, stage: int) -> Path:
    return Path(path) / shard_name(stage)


# ---------------------------------------------------------------------------------------------- writing
def _fsync(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def describe_file(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def write_shard(tmp: Path, stage: int, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Write one stage's shard; returns its manifest entry (size, checksum, sparsity summary)."""
    file = shard_file(tmp, stage)
    torch.save({k: checkpoint[k] for k in SHARD_KEYS if k in checkpoint}, file)
    _fsync(file)
    return {"file": file.name, **describe_file(file), "sparsity": _mask_summary(checkpoint.get("callbacks", {}))}


def write_meta(tmp: Path, checkpoint: dict[str, Any]) -> dict[str, Any]:
    meta = {k: v for k, v in checkpoint.items() if k not in SHARD_KEYS}
    file = tmp / META_FILE
    torch.save(meta, file)
    _fsync(file)
    return {"file": META_FILE, **describe_file(file)}


def _mask_summary(callbacks: dict[str, Any]) -> dict[str, Any]:
    """Per-weight density of the sparsity masks in a shard's callback states (empty when dense)."""
    out: dict[str, Any] = {}
    for state in callbacks.values():
        sparsifier = state.get("sparsifier") if isinstance(state, dict) else None
        if sparsifier:
            out["step"] = state.get("step")
            out.setdefault("density", {}).update(
                {name: round(mask.float().mean().item(), 6) for name, mask in sparsifier["masks"].items()}
            )
            out.setdefault("numel", {}).update({name: mask.numel() for name, mask in sparsifier["masks"].items()})
    return out


def manifest_for(checkpoint: dict[str, Any], layout: dict[str, Any], entries: Iterable[dict]) -> dict[str, Any]:
    entries = [e for e in entries if e]
    sparsity: dict[str, Any] = {}
    for entry in entries:
        summary = entry.pop("sparsity", None) or {}
        if summary:
            sparsity["step"] = summary["step"]
            sparsity.setdefault("density", {}).update(summary["density"])
            sparsity.setdefault("numel", {}).update(summary["numel"])
    if sparsity:
        numel = sparsity.pop("numel")
        kept = sum(sparsity["density"][n] * numel[n] for n in numel)
        sparsity["overall_sparsity"] = round(1 - kept / max(sum(numel.values()), 1), 6)
    return {
        "format": FORMAT,
        "global_step": checkpoint.get("global_step"),
        "epoch": checkpoint.get("epoch"),
        **layout,
        "sparsity": sparsity or None,
        "files": {e["file"]: {"bytes": e["bytes"], "sha256": e["sha256"]} for e in entries},
    }


def save_sharded(
    path: Path,
    checkpoint: dict[str, Any],
    layout: dict[str, Any],
    *,
    stage: int,
    writes_shard: bool,
    is_global_zero: bool,
    barrier: Callable[[str], None],
    gather: Callable[[Any], list[Any]],
) -> None:
    """Collective save: every stage of replica 0 writes its shard into ``PATH.tmp``, rank 0 the metadata
    and, once every file is on disk, the manifest; then rank 0 publishes. ``gather`` collects one object
    per rank on every rank (the shards' manifest entries)."""
    tmp = path.with_name(path.name + ".tmp")
    if is_global_zero:
        if tmp.exists():
            shutil.rmtree(tmp)  # a save that crashed before publishing
        tmp.mkdir(parents=True)
    barrier("pd2bw_save_begin")
    entries = [write_shard(tmp, stage, checkpoint)] if writes_shard else []
    if is_global_zero:
        entries.append(write_meta(tmp, checkpoint))
    everything = [e for part in gather(entries) for e in part]
    if is_global_zero:
        manifest = tmp / MANIFEST
        manifest.write_text(json.dumps(manifest_for(checkpoint, layout, everything), indent=1))
        _fsync(manifest)
        publish(tmp, path)
    barrier("pd2bw_save_published")


def publish(tmp: Path, path: Path) -> None:
    """Swap ``tmp`` into ``path``; the old checkpoint is removed only after the new one is in place."""
    old = path.with_name(path.name + ".old")
    if old.exists() and path.exists():
        shutil.rmtree(old)
    if path.exists():
        path.rename(old)
    tmp.rename(path)
    _fsync_dir(path.parent)
    if old.exists():
        shutil.rmtree(old)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------- reading
def resolve(path: str | Path) -> Path:
    """``path``, or ``path.old`` when a save crashed between its two renames."""
    path = Path(path)
    old = path.with_name(path.name + ".old")
    if not (path / MANIFEST).is_file() and (old / MANIFEST).is_file():
        return old
    return path


def newest_checkpoint(directory: str | Path) -> Path | None:
    """The complete pd2bw checkpoint in ``directory`` with the highest global step (then the newest), or None.
    Unpublished saves (``*.tmp``, no manifest) are skipped; a crash between the two renames counts as its path."""
    found = []
    for path in Path(directory).glob("*") if Path(directory).is_dir() else []:
        if path.name.endswith((".tmp", ".old")) or not path.is_dir():
            continue
        try:
            manifest = read_manifest(path)
        except (FileNotFoundError, ValueError):
            continue
        found.append((manifest["global_step"], resolve(path).stat().st_mtime, path))
    for old in Path(directory).glob("*.old") if Path(directory).is_dir() else []:
        path = old.with_name(old.name[: -len(".old")])
        if not path.exists() and (old / MANIFEST).is_file():  # published, then crashed before the swap finished
            found.append((read_manifest(path)["global_step"], old.stat().st_mtime, path))
    return max(found)[2] if found else None


def read_manifest(path: str | Path) -> dict[str, Any]:
    path = resolve(path)
    file = path / MANIFEST
    if not file.is_file():
        if path.is_file():
            raise ValueError(
                f"{str(path)!r} is a single-file checkpoint, not a pd2bw checkpoint directory; load it with "
                "strategy='auto' (or consolidate it: it already is one)"
            )
        if path.is_dir() and any((path / name).exists() for name in (META_FILE, LEGACY_META_FILE)):
            raise ValueError(
                f"checkpoint {str(path)!r} has no {MANIFEST}: its save never finished (it was interrupted); "
                "resume from the previous checkpoint"
            )
        raise FileNotFoundError(
            f"{str(path)!r} is not a pd2bw checkpoint (no {MANIFEST}); pass a directory written by "
            "strategy='pd2bw' (e.g. by ModelCheckpoint)"
        )
    try:
        manifest = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(
            f"checkpoint {str(path)!r}: {MANIFEST} is corrupt ({error}); use another checkpoint"
        ) from error
    if manifest.get("format") != FORMAT:
        raise ValueError(f"checkpoint {str(path)!r} has format {manifest.get('format')}; this version reads {FORMAT}")
    return manifest


def _load_checked(path: Path, name: str, manifest: dict[str, Any], map_location: Any, verify: bool) -> dict:
    file = path / name
    expected = manifest["files"].get(name)
    if expected is None or not file.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} has no {name}; it is incomplete — use another checkpoint")
    if verify:
        found = describe_file(file)
        if found != expected:
            raise ValueError(
                f"checkpoint {str(path)!r} is corrupt: {name} has {found['bytes']} bytes / sha256 "
                f"{found['sha256'][:12]}..., the manifest says {expected['bytes']} / {expected['sha256'][:12]}...; "
                "the file changed after it was written — use another checkpoint"
            )
    try:
        return torch.load(file, map_location=map_location, weights_only=False)
    except Exception as error:
        raise ValueError(
            f"checkpoint {str(path)!r}: {name} cannot be read ({error}); use another checkpoint"
        ) from error


def read_meta(path: str | Path, verify: bool = True) -> dict[str, Any]:
    manifest = read_manifest(path)
    name = LEGACY_META_FILE if LEGACY_META_FILE in manifest["files"] else META_FILE
    meta = _load_checked(resolve(path), name, manifest, "cpu", verify)
    meta["pd2bw"] = manifest
    return meta


def read_stage(path: str | Path, stage: int, map_location: Any = "cpu", verify: bool = True) -> dict[str, Any]:
    return _load_checked(resolve(path), shard_name(stage), read_manifest(path), map_location, verify)


def same_layout(manifest: dict[str, Any], stage_layers: list[range]) -> bool:
    return [tuple(x) for x in manifest["stage_layers"]] == [(r.start, r.stop) for r in stage_layers]


# ---------------------------------------------------------------------------------------------- resharding
def reshard(
    path: str | Path,
    local_keys: set[str],
    local_names: list[list[list[str]]],
    optimizer_states: list[dict[str, Any]],
    map_location: Any = "cpu",
) -> dict[str, Any]:
    """This stage's part of a checkpoint written with another layout.

    ``local_keys`` are this stage's state-dict keys; ``local_names[k][i]`` are the names of parameter ``i`` of
    this stage's optimizer ``k`` (in the optimizer's order); ``optimizer_states[k]`` is this stage's freshly
    built optimizer ``k``'s ``state_dict()`` (its groups' layout). Every saved shard is read; each entry is
    picked by parameter name, each optimizer's state from the same optimizer of the saving run.
    """
    manifest = read_manifest(path)
    state_dict: dict[str, torch.Tensor] = {}
    per_param: list[dict[str, Any]] = [{} for _ in optimizer_states]
    saved_groups: list[list[dict[str, Any]] | None] = [None for _ in optimizer_states]
    callbacks: dict[str, Any] = {}
    for stage in range(manifest["num_stages"]):
        shard = read_stage(path, stage, map_location)
        state_dict.update({k: v for k, v in shard["state_dict"].items() if k in local_keys})
        saved_states = shard.get("optimizer_states") or []
        saved_names = _names_per_optimizer(shard.get("optimizer_param_names") or [])
        if saved_states and len(saved_states) != len(optimizer_states):
            raise ValueError(
                f"{path} was written with {len(saved_states)} optimizer(s), this run configures {len(optimizer_states)}: "
                "configure the same optimizers as the checkpoint's run"
            )
        for k, (saved, names_of) in enumerate(zip(saved_states, saved_names)):
            saved_groups[k] = saved_groups[k] or saved["param_groups"]
            for index, names in enumerate(names_of):
                if index in saved["state"]:
                    for name in names:
                        per_param[k].setdefault(name, saved["state"][index])
        _merge_callbacks(callbacks, shard.get("callbacks", {}), local_keys)
    out: dict[str, Any] = {"state_dict": state_dict, "callbacks": callbacks}
    if optimizer_states and all(g is not None for g in saved_groups):
        out["optimizer_states"] = []
        for names_of, fresh, saved_of, found_of in zip(local_names, optimizer_states, saved_groups, per_param):
            state = {}
            for index, names in enumerate(names_of):
                found = next((found_of[n] for n in names if n in found_of), None)
                if found is not None:
                    state[index] = found
            groups = [
                {**{k: v for k, v in saved.items() if k != "params"}, "params": group["params"]}
                for group, saved in zip(fresh["param_groups"], saved_of)
            ]
            out["optimizer_states"].append({"state": state, "param_groups": groups})
    return out


def _names_per_optimizer(saved: list[Any]) -> list[list[list[str]]]:
    """``optimizer_param_names`` as one list per optimizer (checkpoints before several optimizers: one flat list)."""
    if saved and saved[0] and isinstance(saved[0][0], str):
        return [saved]
    return saved


def _merge_callbacks(into: dict[str, Any], states: dict[str, Any], wanted: set[str]) -> None:
    """Callback states are per stage; sparsity masks (keyed by weight name) are gathered for ``wanted``; the
    per-layer target densities are every stage's view of the whole model (measuring is a collective), kept whole."""
    for key, state in states.items():
        sparsifier = state.get("sparsifier") if isinstance(state, dict) else None
        if key not in into:
            into[key] = dict(state) if isinstance(state, dict) else state
            if sparsifier:
                into[key]["sparsifier"] = {**sparsifier, "masks": {}, "layer_targets": {}}
        if sparsifier:
            target = into[key]["sparsifier"]
            target["masks"].update({n: m for n, m in sparsifier["masks"].items() if n in wanted})
            targets = sparsifier.get("layer_targets", {})
            target["layer_targets"].update(targets)


# ---------------------------------------------------------------------------------------------- export
def consolidate(path: str | Path) -> dict[str, torch.Tensor]:
    """The full model's state dict from a sharded checkpoint; loads into the plain module."""
    manifest = read_manifest(path)
    state: dict[str, torch.Tensor] = {}
    for stage in range(manifest["num_stages"]):
        state.update(read_stage(path, stage)["state_dict"])
    return state


def export(path: str | Path, out: str | Path) -> Path:
    """Write a single-file Lightning checkpoint of the whole model: ``Model.load_from_checkpoint(out)`` and
    ``torch.load(out)["state_dict"]`` both work; the optimizer state stays in the sharded checkpoint."""
    meta = read_meta(path)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    single = {
        "state_dict": consolidate(path),
        "global_step": meta.get("global_step"),
        "epoch": meta.get("epoch"),
        "pytorch-lightning_version": meta.get("pytorch-lightning_version"),
        **{k: meta[k] for k in ("hyper_parameters", "hparams_name") if k in meta},
    }
    tmp = out.with_name(out.name + ".tmp")
    torch.save(single, tmp)
    _fsync(tmp)
    tmp.replace(out)
    return out


def main(argv: list[str] | None = None) -> None:
    """``pd2bw-consolidate CHECKPOINT_DIR OUT [--format torch|hf]``: export a sharded checkpoint as one file
    (``torch``: a Lightning checkpoint of the whole module) or as a Hugging Face GPT-2 directory (``hf``)."""
    import argparse

    parser = argparse.ArgumentParser(prog="pd2bw-consolidate", description=main.__doc__)
    parser.add_argument("checkpoint", help="a checkpoint directory written by strategy='pd2bw'")
    parser.add_argument("out", help="torch: the single file to write (loads with strategy='auto'); hf: a directory")
    parser.add_argument("--format", choices=["torch", "hf"], default="torch")
    args = parser.parse_args(argv)
    manifest = read_manifest(args.checkpoint)
    where = (
        f"{manifest['num_stages']} stages x {manifest['data_parallel_size']} replicas at step {manifest['global_step']}"
    )
    if args.format == "hf":
        from .models.gpt2_export import export_checkpoint

        directory = export_checkpoint(args.checkpoint, args.out)
        print(f"{directory}: {where} -> Hugging Face GPT-2 (GPT2LMHeadModel.from_pretrained({str(directory)!r}))")
        return
    written = export(args.checkpoint, args.out)
    print(f"{written}: {where} -> one file ({written.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
