"""Interleaved 1F1B in the engine (``Mode.INTERLEAVED``): what a stage holding several chunks needs beyond the
schedule (``schedule.interleaved_order``): its neighbours on the ring (the last stage sends on to the first), its
chunks' sizes, and what the mode does not run yet, refused by name."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .comm.grid import ProcessGrid
from .layout import Layout
from .options import PipelineOptions


def check_interleaved(options: PipelineOptions, layout: Layout, device: torch.device) -> None:
    """A clear error for what interleaved 1F1B does not run yet."""
    if layout.virtual_stages == 1:
        return
    keys = options.keys
    refused = {
        "recompute": options.recompute not in (False, None)
        and any(options.recompute if isinstance(options.recompute, tuple) else [options.recompute]),
        "compile": options.compile not in (False, None),
    }
    for name, set_ in refused.items():
        if set_:
            raise ValueError(
                f"{keys.option(name)} is not supported under {keys.mode}='interleaved' yet (a stage's chunks would "
                f"need it per chunk): leave {name} off, or use {keys.mode}='flush' or 'zb_h1'"
            )
    if device.type == "cuda":
        raise ValueError(
            f"{keys.mode}='interleaved' runs over gloo (CPU processes) only: on NCCL its ring's messages between one "
            "pair of ranks are not yet batched and model-checked against NCCL's ordering (docs/limitations.md); use "
            f"{keys.mode}='zb_h1' or 'flush' on GPUs"
        )


def neighbours(layout: Layout, grid: ProcessGrid) -> tuple[int | None, int | None]:
    """The ranks this stage receives from and sends to (interleaved: around the ring)."""
    if layout.virtual_stages == 1:
        return grid.prev_rank, grid.next_rank
    d = layout.num_stages
    return grid.rank_of((grid.stage - 1) % d), grid.rank_of((grid.stage + 1) % d)


def chunk_sizes(layout: Layout, stage_layers: Sequence[range], stage: int) -> list[int]:
    """The layers of each of ``stage``'s chunks, in order."""
    return [len(stage_layers[v]) for v in layout.chunks(stage)]
