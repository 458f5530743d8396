"""Our flush (1F1B) executor vs torch.distributed.pipelining's Schedule1F1B on the same stages.

``torchrun --nproc-per-node 2 run_pipelining.py OUT``: each rank writes both sets of gradients.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from lightning_pd2bw.engine.comm.grid import ProcessGrid, build_groups
from lightning_pd2bw.engine.comm.transport import StageLink
from lightning_pd2bw.engine.executor import StageExecutor
from lightning_pd2bw.engine.layout import Layout
from lightning_pd2bw.engine.schedules import schedule
from lightning_pd2bw.engine.state.versions import WeightVersions
from tests.stage_update import local_update

NUM_MICROBATCHES, WIDTH, BATCH = 4, 8, 16


def stage_module(stage: int) -> nn.Sequential:
    torch.manual_seed(100 + stage)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh())


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    grid = ProcessGrid(dist.get_rank(), dist.get_world_size(), dist.get_world_size())
    module = stage_module(grid.stage)
    torch.manual_seed(0)
    x, y = torch.randn(BATCH, WIDTH), torch.randn(BATCH, WIDTH)
    loss_fn = nn.functional.mse_loss

    ours: list[torch.Tensor] = []
    versions = WeightVersions(module.parameters(), False)
    executor = StageExecutor(
        list(module),
        grid.stage,
        Layout(grid.num_stages, NUM_MICROBATCHES, "flush"),
        StageLink(grid.prev_rank, grid.next_rank, torch.device("cpu"), build_groups(grid, []).link),
        versions,
        input_fn=lambda mb: mb["x"],
        loss_fn=lambda out, mb: loss_fn(out, mb["y"]),
        handlers=local_update(versions, lambda batch: ours.extend(p.grad.clone() for p in module.parameters())),
    )
    executor.feed(0, [{"x": a, "y": b} for a, b in zip(x.chunk(NUM_MICROBATCHES), y.chunk(NUM_MICROBATCHES))])
    actions = schedule.segment(Layout(grid.num_stages, NUM_MICROBATCHES, "flush"), grid.stage, 0)
    executor.run(actions)
    executor.finish_drain()
    module.zero_grad(set_to_none=True)

    stage = PipelineStage(module, grid.stage, grid.num_stages, torch.device("cpu"))
    reference = Schedule1F1B(stage, n_microbatches=NUM_MICROBATCHES, loss_fn=loss_fn)
    if grid.stage == 0:
        reference.step(x)
    elif grid.stage == grid.num_stages - 1:
        reference.step(target=y)
    else:
        reference.step()
    theirs = [p.grad.clone() for p in module.parameters()]
    torch.save({"ours": ours, "theirs": theirs}, Path(sys.argv[1]) / f"grads-{grid.rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
