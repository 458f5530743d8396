"""Every stage reports the last stage's loss whatever the default dtype (``precision="64-true"`` sets float64):
``torchrun --nproc-per-node=2 run_loss_dtype.py OUT``; each rank writes the losses ``train_batch`` returned."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

torch.set_num_threads(1)

from lightning_pd2bw.engine import PipelineEngine, PipelineOptions  # noqa: E402


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)]
    engine = PipelineEngine(
        layers,
        PipelineOptions(num_stages=2, num_microbatches=2, mode="flush"),
        lambda batch: batch["x"],
        lambda output, batch: ((output - batch["y"]) ** 2).mean(),
        device="cpu",
    )
    engine.start(torch.optim.SGD(engine.parameters(), lr=0.1))
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(3):
        batch = {"x": torch.randn(4, 4, generator=generator), "y": torch.randn(4, 1, generator=generator)}
        losses.append(engine.train_batch(batch).item())
    engine.drain()
    engine.close()
    torch.save(losses, out / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
