"""A weight tied across stages, initialised by the stage that is not the first: ``torchrun --nproc-per-node=2 ...
OUT MODE``. The model (torchtitan's tied shape) is built on the meta device; its ``init_layer`` writes the tied
weight from the head (last stage) and skips it at the embedding (first stage). MODE ``head``: each rank writes
``OUT/rank{r}.pt`` with its copy after setup; ``none``: no stage writes it, and setup's error goes to that file.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from lightning_pd2bw.engine import PipelineEngine, PipelineOptions  # noqa: E402
from lightning_pd2bw.engine.materialize import parameters_on_meta  # noqa: E402

VOCAB, WIDTH = 12, 8


def head_init(weight: torch.Tensor) -> None:
    torch.manual_seed(7)
    nn.init.trunc_normal_(weight, std=WIDTH**-0.5)


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    with parameters_on_meta():
        layers = [nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, VOCAB, bias=False)]
    layers[2].weight = layers[0].weight  # tied: the output is the embedding

    def init_layer(index: int) -> None:
        if index == 1:
            layers[1].reset_parameters()
        elif index == 2 and mode == "head":
            head_init(layers[2].weight)  # the embedding (index 0) leaves the tied weight to the head

    options = PipelineOptions(num_stages=2, num_microbatches=2, layers_per_stage=(2, 1), mode="flush")
    result: dict = {}
    try:
        engine = PipelineEngine(layers, options, lambda b: b, lambda o, b: o.sum(), device="cpu", init_layer=init_layer)
        index = 0 if engine.stage == 0 else 2
        result["tied"] = layers[index].weight.detach().clone()
        engine.close()
    except RuntimeError as error:
        result["error"] = str(error)
    torch.save(result, out / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
