"""What a checkpoint costs per GiB of one rank's state: the time training is blocked, and the time in the background.

    python benchmarks/checkpoint_staging.py                 # 1 GiB on the GPU if there is one, else on the CPU
    python benchmarks/checkpoint_staging.py --gib 4 --reps 3

One process writes ``--gib`` GiB of float32 tensors (256 MiB each) the way a stage's save does
(``checkpoint.store.write_state``, DCP, fsynced files) into a temporary folder, two ways: synchronous (training
waits for all of it), and asynchronous as ``async_checkpoint=True`` runs it (``HostStager`` kept across saves:
pinned host memory on a GPU; training waits only for the copy to the host, then the files are written in the
background). The first asynchronous save allocates the stager's host buffers; the figures are the medians of the
saves after it. Prints seconds per GiB: the input of the dry run's checkpoint cost (``planner/checkpoint_cost.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lightning_pd2bw.checkpoint.host_stager import HostStager
from lightning_pd2bw.checkpoint.store import write_state

GiB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    count = max(1, round(args.gib * 4))
    entries = {f"state/{i}": torch.randn(2**26, device=device) for i in range(count)}  # 256 MiB each
    size = sum(t.numel() * t.element_size() for t in entries.values()) / GiB
    stager = HostStager()  # as lightning/checkpoints.py stages (pinned host buffers on a GPU)
    sync, blocked, background = [], [], []
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        for rep in range(args.reps + 1):
            start = time.perf_counter()
            write_state(Path(root) / f"sync-{rep}", entries)
            sync.append(time.perf_counter() - start)
            start = time.perf_counter()
            future = write_state(Path(root) / f"async-{rep}", entries, asynchronous=True, stager=stager)
            if cuda:
                torch.cuda.synchronize()
            staged = time.perf_counter()
            future.result()
            blocked.append(staged - start)
            background.append(time.perf_counter() - staged)
    stager.close()
    record = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "gib": size,
        "sync_s_per_gib": statistics.median(sync[1:]) / size,
        "async_blocking_s_per_gib": statistics.median(blocked[1:]) / size,
        "async_background_s_per_gib": statistics.median(background[1:]) / size,
        "first_async_blocking_s_per_gib": blocked[0] / size,
    }
    print(json.dumps(record, indent=1))
    print(
        f"{record['device']}: {size:.2f} GiB per save; synchronous {record['sync_s_per_gib']:.3f} s/GiB; "
        f"asynchronous: training blocked {record['async_blocking_s_per_gib']:.3f} s/GiB, then "
        f"{record['async_background_s_per_gib']:.3f} s/GiB in the background (first save: "
        f"{record['first_async_blocking_s_per_gib']:.3f} s/GiB blocked, allocating the host buffers)"
    )


if __name__ == "__main__":
    main()
