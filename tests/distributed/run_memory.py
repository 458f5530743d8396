"""2-stage runs of ``PipelineEngine`` with large boundary messages (4 MiB each way per microbatch), to measure
what a stage holds as the number of microbatches grows: ``OUT/memory-m{M}-{MODE}-rank{R}.json`` gets the peak
resident memory during the run and the engine's counters.

Usage: torchrun --nproc-per-node=2 run_memory.py OUT RUN [RUN ...], each RUN ``M-MODE``, ``M-MODE-adamw`` or
``M-MODE-pef`` (AdamW with 2BW's error feedback, or its predictive form, for the planner's optimizer and correction
terms), MODE ``2bw``,
``flush`` or ``2bw-default`` (2BW, told apart by the test that sets no allocator options). The runs of one
process follow one another, each with a fresh engine: before each, the kernel's peak resident memory (VmHWM) is
reset to what the process holds (``/proc/self/clear_refs``), so each run's peak is its own."""

from __future__ import annotations

import gc
import json
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lightning_pd2bw import PipelineEngine
from lightning_pd2bw.engine.options import PipelineOptions

WIDTH = 1 << 18  # floats per sample: 1 MiB
CORRECTIONS = {"adamw": "error_feedback", "pef": "predictive_error_feedback"}  # a RUN's suffix -> AdamW + this
SAMPLES = 4  # per microbatch: a 4 MiB message


class Widen(nn.Module):
    """A (samples, 1) seed to (samples, WIDTH) activations: big messages from almost no compute or input."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, seed: torch.Tensor) -> torch.Tensor:
        return seed.expand(-1, WIDTH) * self.scale


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def peak_rss_bytes() -> int:
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def reset_peak_rss() -> None:
    """From now on VmHWM is the peak of what the process holds from here (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def measure(out: Path, run: str) -> None:
    m, label = run.split("-", 1)
    correction = CORRECTIONS.get(label.rsplit("-", 1)[-1])
    num_microbatches, adamw = int(m), correction is not None
    mode = label.split("-")[0]
    gc.collect()
    reset_peak_rss()
    engine = PipelineEngine(
        [Widen(), Scale()],
        PipelineOptions(
            num_stages=2, num_microbatches=num_microbatches, mode=mode, delay_correction=correction, sync_steps=0
        ),
        lambda batch: batch["seed"],
        lambda output, batch: output.mean(),
        device="cpu",
    )
    optimizer = torch.optim.AdamW if adamw else torch.optim.SGD
    engine.start(optimizer(engine.parameters(), lr=0.1))
    seeds = torch.ones(num_microbatches * SAMPLES, 1)
    peaks = []
    for _ in range(4):
        engine.train_batch({"seed": seeds})
        peaks.append(engine.counters())
    engine.drain()
    record = {
        "max_rss_bytes": peak_rss_bytes(),
        "message_bytes": SAMPLES * WIDTH * 4,
        "counters": engine.counters(),
        "peak_transport_bytes": max(c["peak_transport_bytes"] for c in peaks),
        "during": {key: max(c[key] for c in peaks) for key in peaks[0]},  # the largest after each batch
    }
    (out / f"memory-m{run}-rank{dist.get_rank()}.json").write_text(json.dumps(record))
    engine.close()


def main() -> None:
    out, runs = Path(sys.argv[1]), sys.argv[2:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for run in runs:
        measure(out, run)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
