"""One 2-stage run of ``PipelineEngine`` with large boundary messages (4 MiB each way per microbatch), to measure
what a stage holds as the number of microbatches grows: ``OUT/memory-m{M}-rank{R}.json`` gets the process's peak
resident memory and the engine's counters. Usage: torchrun --nproc-per-node=2 run_memory.py OUT M MODE [adamw]
(``adamw``: AdamW with 2BW's delay correction, for the planner's optimizer and correction terms)."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lightning_pd2bw import PipelineEngine
from lightning_pd2bw.engine.layout import Layout

WIDTH = 1 << 18  # floats per sample: 1 MiB
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


def main() -> None:
    out, num_microbatches, mode = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3].removesuffix("-default")
    label = sys.argv[3]  # "2bw-default": the same run, told apart by the test that sets no allocator options
    adamw = sys.argv[4:] == ["adamw"]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    engine = PipelineEngine(
        [Widen(), Scale()],
        Layout(2, num_microbatches, mode),
        lambda batch: batch["seed"],
        lambda output, batch: output.mean(),
        device="cpu",
        delay_correction="error_feedback" if adamw else None,
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
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "message_bytes": SAMPLES * WIDTH * 4,
        "counters": engine.counters(),
        "peak_transport_bytes": max(c["peak_transport_bytes"] for c in peaks),
        "during": {key: max(c[key] for c in peaks) for key in peaks[0]},  # the largest after each batch
    }
    name = f"memory-m{num_microbatches}-{label}{'-adamw' if adamw else ''}-rank{dist.get_rank()}.json"
    (out / name).write_text(json.dumps(record))
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
