"""What checkpoints' checksums cost: DCP's save with and without each file's CRC32C taken as it is written, and a
load with and without verifying the files it reads, side by side in one process, alternated rounds, medians.

    python benchmarks/checkpoint_checksums.py                  # 2 GiB of float32 state, 3 rounds
    python benchmarks/checkpoint_checksums.py --gib 4 --rounds 5

Prints each leg's median seconds, the overhead in seconds per GiB, and that overhead at ``--at-gib`` (default 13.8:
the fullest rank of the gpt13b recipe's checkpoint, ``docs/_generated/recipe-checkpoint-gpt13b.md``)."""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from lightning_pd2bw.checkpoint.checksums import ChecksumWriter, collect, file_crc32c  # noqa: E402

MIB = 1 << 20


def state(gib: float) -> dict[str, torch.Tensor]:
    count = max(int(gib * 1024 / 64), 1)  # 64 MiB tensors, as a stage's larger matrices
    return {f"model/w{i}": torch.randn(16 * MIB) for i in range(count)}


def save(folder: Path, entries: dict, checksums: bool) -> float:
    shutil.rmtree(folder, ignore_errors=True)
    writer = (ChecksumWriter if checksums else FileSystemWriter)(folder, sync_files=True)
    start = time.perf_counter()
    dcp.save(entries, storage_writer=writer, no_dist=True)
    if checksums:
        collect(folder)
    return time.perf_counter() - start


def load(folder: Path, entries: dict, verify: bool) -> float:
    """Into the state's own tensors (a second copy of a 13.8 GiB state would not fit this machine's memory); what is
    read is what was written, so the tensors end as they were."""
    request = dict(entries)
    start = time.perf_counter()
    if verify:
        for file in folder.glob("*.distcp"):
            file_crc32c(file)
    dcp.load(request, storage_reader=FileSystemReader(folder), no_dist=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--at-gib", type=float, default=13.8)
    args = parser.parse_args()
    torch.manual_seed(0)
    entries = state(args.gib)
    gib = sum(t.numel() * t.element_size() for t in entries.values()) / 2**30
    times: dict[str, list[float]] = {"save": [], "save+crc32c": [], "load": [], "load+verify": []}
    with tempfile.TemporaryDirectory(dir=ROOT / "outputs" if (ROOT / "outputs").is_dir() else None) as tmp:
        folder = Path(tmp) / "ckpt"
        for _ in range(args.rounds):
            times["save"].append(save(folder, entries, False))
            times["save+crc32c"].append(save(folder, entries, True))
            times["load"].append(load(folder, entries, False))
            times["load+verify"].append(load(folder, entries, True))
    median = {leg: statistics.median(values) for leg, values in times.items()}
    print(f"{gib:.2f} GiB of state, {args.rounds} alternated rounds (medians):")
    for leg, value in median.items():
        print(f"  {leg:12s} {value:7.2f} s  ({gib / value:5.2f} GiB/s)  rounds {[round(v, 2) for v in times[leg]]}")
    for kind, base, checked in (("save", "save", "save+crc32c"), ("load", "load", "load+verify")):
        extra = (median[checked] - median[base]) / gib
        print(
            f"{kind}: {median[checked] / median[base]:.3f}x, {extra:+.3f} s per GiB; "
            f"at {args.at_gib} GiB: {extra * args.at_gib:+.1f} s on {median[base] / gib * args.at_gib:.1f} s"
        )


if __name__ == "__main__":
    main()
