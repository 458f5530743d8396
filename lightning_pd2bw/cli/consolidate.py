"""``pd2bw-consolidate``: a sharded checkpoint as one Lightning file of the whole module (``--format torch``), as a
Hugging Face GPT-2 directory (``--format hf``), or a checkpoint of an earlier format converted into this one
(``--upgrade``)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.entries import entries_of
from ..checkpoint.store import (
    FORMAT,
    LEGACY_META_FILE,
    META_FILE,
    check_files,
    consolidate,
    finish,
    fsync_file,
    read_manifest,
    read_meta,
    resolve,
    write_state,
)


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
    fsync_file(tmp)
    tmp.replace(out)
    return out


def upgrade(old: str | Path, new: str | Path) -> Path:
    """Convert a format-1 checkpoint (one ``stage-NNN.pt`` per stage) into this format at ``new``."""
    old, new = resolve(old), Path(new)
    manifest = read_manifest(old, any_format=True)
    if manifest.get("format") != 1:
        raise ValueError(f"{str(old)!r} has format {manifest.get('format')}; --upgrade converts format 1")
    check_files(old, manifest)
    entries: dict[str, Any] = {}
    for stage in range(manifest["num_stages"]):
        shard = torch.load(old / f"stage-{stage:03d}.pt", map_location="cpu", weights_only=False)
        entries.update(entries_of(shard, stage))
    tmp = new.with_name(new.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    meta = LEGACY_META_FILE if LEGACY_META_FILE in manifest["files"] else META_FILE
    shutil.copyfile(old / meta, tmp / META_FILE)
    write_state(tmp, entries)
    finish(tmp, new, {**{k: v for k, v in manifest.items() if k != "files"}, "format": FORMAT})
    return new


def main(argv: list[str] | None = None) -> None:
    """``pd2bw-consolidate CHECKPOINT_DIR OUT [--format torch|hf | --upgrade]``: export a sharded checkpoint as one
    file (``torch``: a Lightning checkpoint of the whole module), as a Hugging Face GPT-2 directory (``hf``), or
    convert a checkpoint of an earlier format into this one (``--upgrade``: OUT is the new checkpoint directory)."""
    import argparse

    parser = argparse.ArgumentParser(prog="pd2bw-consolidate", description=main.__doc__)
    parser.add_argument("checkpoint", help="a checkpoint directory written by strategy='pd2bw'")
    parser.add_argument("out", help="torch: the single file to write (loads with strategy='auto'); hf: a directory")
    parser.add_argument("--format", choices=["torch", "hf"], default="torch")
    parser.add_argument("--upgrade", action="store_true", help=f"write OUT as a format-{FORMAT} checkpoint")
    args = parser.parse_args(argv)
    if args.upgrade:
        written = upgrade(args.checkpoint, args.out)
        print(f"{written}: {args.checkpoint} converted to format {FORMAT}; resume with ckpt_path={str(written)!r}")
        return
    manifest = read_manifest(args.checkpoint)
    where = (
        f"{manifest['num_stages']} stages x {manifest['data_parallel_size']} replicas at step {manifest['global_step']}"
    )
    if args.format == "hf":
        from ..models.gpt2_export import export_checkpoint

        directory = export_checkpoint(args.checkpoint, args.out)
        print(f"{directory}: {where} -> Hugging Face GPT-2 (GPT2LMHeadModel.from_pretrained({str(directory)!r}))")
        return
    written = export(args.checkpoint, args.out)
    print(f"{written}: {where} -> one file ({written.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
