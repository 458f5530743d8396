"""Sharded checkpoints on ``torch.distributed.checkpoint`` (DCP), with a manifest, published atomically.

Layout of a checkpoint ``PATH`` (a directory, so ``ModelCheckpoint``'s ``*.ckpt`` names work)::

    PATH/manifest.json    written last: format, step, layout, weight-version state, data position, sparsity,
                          schedule horizon, every file's size (a checkpoint without it was never published)
    PATH/trainer.pt       Lightning's loops, schedulers, hparams ... from global rank 0 (not "meta.pt": that name
                          makes Lightning's consolidate_checkpoint take the directory for one of its own)
    PATH/.metadata        DCP's index of the entries (names in ``checkpoint/entries.py``: model, optimizer state
    PATH/__R_0.distcp     by parameter name, callbacks, masks), and the files the ranks wrote in parallel

Every rank writes its stage's entries into ``PATH.tmp`` (DCP writes each name once: replicas are deduplicated and
the writes spread over the ranks; optionally asynchronously, from a copy staged on the host); once DCP has
finished (its ``.metadata`` is written after every rank's files), global rank 0 writes the manifest and swaps
the directory into place (``PATH`` -> ``PATH.old``, ``PATH.tmp`` -> ``PATH``, remove ``PATH.old``). A crash at any
point leaves a complete previous checkpoint: ``PATH`` itself, or ``PATH.old`` during the two renames, which
``resolve`` then uses.

Loading asks DCP for this stage's names only, at any depth x width (a reshard reads the bytes each new stage
owns, nothing else); a checkpoint of another format, or with a damaged manifest, is refused by name
(``UnreadableCheckpoint``). ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save(PATH, FILE)`` reads the
entries too.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import (
    CheckpointException,
    DefaultSavePlanner,
    FileSystemReader,
)

from .checksums import ChecksumWriter, collect, verify
from .entries import (
    STAGE_KEYS,
    by_parameter,
    empty_for,
    entries_of,
    request_for,
    stage_checkpoint,
)
from .preflight import (  # noqa: F401  (re-exported)
    SHARED_PROBE,
    check_shared,
    check_shared_folder,
    check_space,
    out_of_space_named,
)
from .safe_load import SafeLoadPlanner, UnreadableCheckpoint, load_object, read_metadata, unwrapped

META_FILE = "trainer.pt"
MANIFEST = "manifest.json"
FORMAT = 2
_publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pd2bw-publish")


# ---------------------------------------------------------------------------------------------- writing
def fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def write_meta(tmp: Path, checkpoint: dict[str, Any]) -> None:
    file = tmp / META_FILE
    torch.save({k: v for k, v in checkpoint.items() if k not in STAGE_KEYS}, file)
    fsync_file(file)


def write_state(
    folder: Path, entries: dict[str, Any], process_group: Any = None, asynchronous: bool = False, stager: Any = None
) -> Future | None:
    """DCP's collective save of every rank's entries into ``folder`` (no flattening: the names are ours).
    ``asynchronous``: return once the entries are staged on the host (by ``stager``, a DCP ``AsyncStager`` kept
    across saves so that its pinned host buffers are reused; None: DCP's default); the future completes when
    every rank's files are written."""
    writer = ChecksumWriter(folder, sync_files=True)  # each file's CRC32C taken as it is written (checksums.py)
    planner = DefaultSavePlanner(flatten_state_dict=False)
    no_dist = not torch.distributed.is_initialized()
    if asynchronous:
        return dcp.async_save(
            entries,
            storage_writer=writer,
            planner=planner,
            process_group=process_group,
            async_stager=stager,
            no_dist=no_dist,
        )
    dcp.save(entries, storage_writer=writer, planner=planner, process_group=process_group, no_dist=no_dist)
    return None


def _mask_summary(callbacks: dict[str, Any]) -> dict[str, Any]:
    """Per-parameter density of the callbacks' ``masks`` entries (``entries.BY_PARAMETER``; empty when dense)."""
    out: dict[str, Any] = {}
    for state in callbacks.values():
        masks = by_parameter(state, "masks")
        if masks:
            out["step"] = state.get("step") if isinstance(state, dict) else None
            out.setdefault("density", {}).update({n: round(m.float().mean().item(), 6) for n, m in masks.items()})
            out.setdefault("numel", {}).update({name: mask.numel() for name, mask in masks.items()})
    return out


def manifest_for(checkpoint: dict[str, Any], layout: dict[str, Any], summaries: Iterable[dict]) -> dict[str, Any]:
    sparsity: dict[str, Any] = {}
    for summary in summaries:
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
    }


def save_sharded(
    path: Path,
    checkpoint: dict[str, Any],
    layout: dict[str, Any],
    *,
    stage: int,
    is_global_zero: bool,
    barrier: Callable[[str], None],
    gather: Callable[[Any], list[Any]],
    process_group: Any = None,
    asynchronous: bool = False,
    stager: Any = None,
) -> Future | None:
    """Collective save: every rank gives its stage's entries to DCP in ``PATH.tmp``, rank 0 also the trainer
    state; once DCP has finished, rank 0 writes the manifest and publishes. ``gather`` collects one object per
    rank on every rank (the masks' summaries). ``asynchronous``: returns a future once the entries are staged
    (on rank 0 it completes when the checkpoint is published); wait for it before the next save. An asynchronous
    save needs a ``process_group`` of its own (gloo), not one that training uses at the same time."""
    tmp = path.with_name(path.name + ".tmp")
    if is_global_zero:
        if tmp.exists():
            shutil.rmtree(tmp)  # a save that crashed before publishing
        tmp.mkdir(parents=True)
    barrier("pd2bw_save_begin")
    check_shared(tmp, is_global_zero, gather)
    entries = entries_of(checkpoint, stage)
    try:
        check_space(tmp, stage, entries, gather)
    except OSError:
        if is_global_zero:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    manifest = manifest_for(checkpoint, layout, gather(_mask_summary(checkpoint.get("callbacks", {}))))
    with out_of_space_named(tmp):
        if is_global_zero:
            write_meta(tmp, checkpoint)
        written = write_state(tmp, entries, process_group, asynchronous, stager)
    if written is not None:
        return _publisher.submit(lambda: (written.result(), finish(tmp, path, manifest))) if is_global_zero else written
    if is_global_zero:
        finish(tmp, path, manifest)
    barrier("pd2bw_save_published")
    return None


def finish(tmp: Path, path: Path, manifest: dict[str, Any]) -> None:
    """Rank 0, once every file is in ``tmp``: the manifest (with every file's size and CRC32C), then the swap."""
    sums = collect(tmp)
    files = {f.name: {"bytes": f.stat().st_size, "crc32c": sums[f.name]} for f in sorted(tmp.iterdir()) if f.is_file()}
    file = tmp / MANIFEST
    file.write_text(json.dumps({**manifest, "files": files}, indent=1))
    fsync_file(file)
    publish(tmp, path)


def publish(tmp: Path, path: Path) -> None:
    """Swap ``tmp`` into ``path``; the old checkpoint is removed only after the new one is in place.

    ``path`` may be a link (``last.ckpt`` under ``save_last: link`` points to the newest periodic checkpoint): the
    link is replaced, and the checkpoint it points to is kept (never removed through the link)."""
    old = path.with_name(path.name + ".old")
    if _present(old) and _present(path):
        remove(old)
    if _present(path):
        path.rename(old)  # a link is renamed as a link
    tmp.rename(path)
    _fsync_dir(path.parent)
    if _present(old):
        remove(old)


def _present(path: Path) -> bool:
    """``path`` exists, as a file, folder or link (a dangling link included)."""
    return path.is_symlink() or path.exists()


def remove(path: Path) -> None:
    """Remove a checkpoint folder, or only the link when ``path`` is one (its target is another checkpoint)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.exists():
        shutil.rmtree(path)


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


def read_manifest(path: str | Path) -> dict[str, Any]:
    path = resolve(path)
    file = path / MANIFEST
    if not file.is_file():
        if path.is_file():
            raise ValueError(
                f"{str(path)!r} is a single-file checkpoint, not a pd2bw checkpoint directory; load it with "
                "strategy='auto' (or consolidate it: it already is one)"
            )
        if path.is_dir() and (path / META_FILE).exists():
            raise ValueError(
                f"checkpoint {str(path)!r} has no {MANIFEST}: its save never finished (it was interrupted); "
                "resume from the previous checkpoint"
            )
        if not path.exists():
            raise FileNotFoundError(
                f"{str(path)!r} does not exist; pass a checkpoint directory written by strategy='pd2bw'"
            )
        raise FileNotFoundError(
            f"{str(path)!r} is not a pd2bw checkpoint (no {MANIFEST}); pass a directory written by "
            "strategy='pd2bw' (e.g. by ModelCheckpoint)"
        )
    try:
        manifest = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise UnreadableCheckpoint(
            f"checkpoint {str(path)!r}: {MANIFEST} is damaged ({error}); it was not resumed from: use another "
            "checkpoint (pass it as ckpt_path, or move this one away so that ckpt_path='last' finds the one before)"
        ) from error
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        hint = (
            " (format 1: one stage-NNN.pt per stage, written by lightning_pd2bw before 0.1.0's DCP checkpoints; "
            "convert it with lightning_pd2bw 0.1.x: pd2bw-consolidate PATH NEW_PATH --upgrade)"
            if found == 1
            else ""
        )
        raise UnreadableCheckpoint(
            f"checkpoint {str(path)!r} has format {found!r}{hint}; lightning_pd2bw {_version()} reads format {FORMAT}"
        )
    return manifest


def _version() -> str:
    from .. import __version__

    return __version__


def check_files(path: Path, manifest: dict[str, Any]) -> None:
    """Every file the manifest lists is there with its size (cheap: no re-read of the data)."""
    for name, expected in manifest["files"].items():
        file = path / name
        if not file.is_file():
            raise FileNotFoundError(
                f"checkpoint {str(path)!r} has no {name}; it is incomplete — use another checkpoint"
            )
        if file.stat().st_size != expected["bytes"]:
            raise ValueError(
                f"checkpoint {str(path)!r} is corrupt: {name} has {file.stat().st_size} bytes, the manifest says "
                f"{expected['bytes']}; the file changed after it was written — use another checkpoint"
            )


def _checked(path: str | Path) -> tuple[Path, dict[str, Any]]:
    manifest = read_manifest(path)
    folder = resolve(path)
    check_files(folder, manifest)
    verify(folder, manifest, [".metadata"])  # DCP's index, read before any entry
    return folder, manifest


def read_meta(path: str | Path) -> dict[str, Any]:
    folder, manifest = _checked(path)
    verify(folder, manifest, [META_FILE])
    meta = load_object(folder / META_FILE, "checkpoint file")  # weights_only: nothing in it runs (safe_load.py)
    meta["pd2bw"] = manifest
    return meta


def _load(folder: Path, request: dict[str, Any]) -> None:
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled")  # reading alone is what we ask for
            dcp.load(
                request,
                storage_reader=FileSystemReader(folder),
                planner=SafeLoadPlanner(),  # byte entries with weights_only=True
                no_dist=True,  # each rank reads its own entries; no collective
            )
    except UnreadableCheckpoint:
        raise
    except (Exception, CheckpointException) as error:  # DCP's CheckpointException is a BaseException
        if (refused := unwrapped(error)) is not None:
            raise UnreadableCheckpoint(f"checkpoint {str(folder)!r}: {refused}; use another checkpoint") from None
        raise ValueError(f"checkpoint {str(folder)!r} cannot be read ({error}); use another checkpoint") from error


def read_entries(
    path: str | Path, prefix: str = "", device: torch.device | str = "cpu", names: set[str] | None = None
) -> dict[str, Any]:
    """The entries whose names start with ``prefix`` (e.g. ``"model/"``, ``"masks/"``), read into new tensors;
    ``names``: only those of them (only their bytes are read)."""
    folder, manifest = _checked(path)
    metadata = read_metadata(folder).state_dict_metadata
    request = {
        name: empty_for(entry, device)
        for name, entry in metadata.items()
        if name.startswith(prefix) and (names is None or name in names)
    }
    verify(folder, manifest, files_of(folder, request))
    _load(folder, request)
    return request


def load_stage(
    path: str | Path,
    *,
    stage: int,
    stage_layers: list[range],
    model: dict[str, torch.Tensor],
    names: list[list[list[str]]],
    fresh: list[dict[str, Any]],
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """This stage's part of a checkpoint written at any depth x width: ``model`` (this stage's state-dict tensors)
    is read in place; ``names[k][i]`` are the names of parameter ``i`` of this stage's optimizer ``k`` and
    ``fresh[k]`` its ``state_dict()`` (its groups' layout). Returns Lightning's per-stage keys (``state_dict``,
    ``optimizer_states``, ``callbacks``); only this stage's bytes are read."""
    folder, manifest = _checked(path)
    metadata = read_metadata(folder).state_dict_metadata
    same = same_layout(manifest, stage_layers)
    request = request_for(metadata, stage=stage, same_layout=same, model=model, names=names, device=device)
    verify(folder, manifest, files_of(folder, request))
    _load(folder, request)
    return stage_checkpoint(request, stage=stage, same_layout=same, names=names, fresh=fresh)


def files_of(folder: Path, request: dict[str, Any]) -> set[str]:
    """The files holding the entries ``request`` names (their bytes are what a load reads)."""
    storage = read_metadata(folder).storage_data or {}
    return {info.relative_path for index, info in storage.items() if index.fqn in request}


def same_layout(manifest: dict[str, Any], stage_layers: list[range]) -> bool:
    return [tuple(x) for x in manifest["stage_layers"]] == [(r.start, r.stop) for r in stage_layers]


def consolidate(path: str | Path) -> dict[str, torch.Tensor]:
    """The full model's state dict from a sharded checkpoint; loads into the plain module.

    Args:
        path: a checkpoint directory written by the strategy or ``PipelineEngine.save`` (any depth x width).
    """
    return {name[len("model/") :]: value for name, value in read_entries(path, "model/").items()}
