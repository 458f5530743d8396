"""``pd2bw-consolidate``: a sharded checkpoint as one Lightning file of the whole module (``--format torch``), as a
Hugging Face GPT-2 directory (``--format hf``)."""

from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint.store import (
    consolidate,
    fsync_file,
    read_manifest,
    read_meta,
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


def main(argv: list[str] | None = None) -> None:
    from .train import refused

    try:
        _consolidate(argv)
    except BaseException as error:
        refused(error, "pd2bw-consolidate")
        raise


def _consolidate(argv: list[str] | None) -> None:
    """``pd2bw-consolidate CHECKPOINT_DIR OUT [--format torch|hf]``: export a sharded checkpoint as one file
    (``torch``: a Lightning checkpoint of the whole module) or as a Hugging Face GPT-2 directory (``hf``)."""
    import argparse

    parser = argparse.ArgumentParser(prog="pd2bw-consolidate", description=_consolidate.__doc__)
    parser.add_argument("checkpoint", help="a checkpoint directory written by strategy='pd2bw'")
    parser.add_argument("out", help="torch: the single file to write (loads with strategy='auto'); hf: a directory")
    parser.add_argument("--format", choices=["torch", "hf"], default="torch")
    args = parser.parse_args(argv)
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
