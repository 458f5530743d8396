"""A 3-stage pipeline whose boundaries carry integer and float tensors in any order: ``(mask, hidden)`` leaves
stage 0 (the integer first), ``(hidden, mask)`` leaves stage 1. Trains with ``PipelineEngine`` under each MODE
in turn and saves each stage's weights to ``OUT/boundaries-MODE-rankR.pt``. Usage: torchrun --nproc-per-node=3
run_boundaries.py OUT MODE [MODE ...] (the reference is in ``test_boundaries.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from lightning_pd2bw import PipelineEngine
from lightning_pd2bw.engine.options import PipelineOptions

NUM_MICROBATCHES, SAMPLES, STEPS, LR = 3, 2, 4, 0.1


class MaskFirst(nn.Linear):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (x[:, :1] > -0.5).long(), torch.tanh(super().forward(x))


class MaskedHidden(nn.Linear):
    def forward(self, mask: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(super().forward(hidden)) * mask, mask


class Head(nn.Linear):
    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return super().forward(hidden) + mask


def layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [MaskFirst(4, 4), MaskedHidden(4, 4), Head(4, 4)]


def batches() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    size = NUM_MICROBATCHES * SAMPLES
    return [
        {"x": torch.randn(size, 4, generator=generator), "y": torch.randn(size, 4, generator=generator)}
        for _ in range(STEPS)
    ]


def loss_fn(output: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return ((output - batch["y"]) ** 2).mean()


def train(out: Path, mode: str) -> None:
    engine = PipelineEngine(
        layers(),
        PipelineOptions(
            num_stages=3, num_microbatches=NUM_MICROBATCHES, mode=mode, delay_correction=None, sync_steps=0
        ),
        lambda b: b["x"],
        loss_fn,
        device="cpu",
    )  # the reference is the plain 2BW rule
    engine.start(torch.optim.SGD(engine.parameters(), lr=LR))
    for batch in batches():
        engine.train_batch(batch)
    engine.drain()
    torch.save(engine.state_dict()["layers"], out / f"boundaries-{mode}-rank{dist.get_rank()}.pt")
    engine.close()


def main() -> None:
    out, modes = Path(sys.argv[1]), sys.argv[2:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for mode in modes:  # one engine after another in the same processes
        train(out, mode)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
