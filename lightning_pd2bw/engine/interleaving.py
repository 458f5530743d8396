"""Interleaved 1F1B in the engine (``Mode.INTERLEAVED``): what a stage holding several chunks needs beyond the
schedule (``schedule.interleaved_order``): its neighbours on the ring (the last stage sends on to the first), its
messages staged for their tick's batch (``schedules/lockstep.py``), its chunks' sizes, and what the mode does not run
yet, refused by name."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from .comm.grid import ProcessGrid
from .layout import Layout
from .options import PipelineOptions
from .schedules import schedule as S


def check_interleaved(options: PipelineOptions, layout: Layout) -> None:
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


def neighbours(layout: Layout, grid: ProcessGrid) -> tuple[int | None, int | None]:
    """The ranks this stage receives from and sends to (interleaved: around the ring)."""
    if layout.virtual_stages == 1:
        return grid.prev_rank, grid.next_rank
    d = layout.num_stages
    return grid.rank_of((grid.stage - 1) % d), grid.rank_of((grid.stage + 1) % d)


def chunk_sizes(layout: Layout, stage_layers: Sequence[range], stage: int) -> list[int]:
    """The layers of each of ``stage``'s chunks, in order."""
    return [len(stage_layers[v]) for v in layout.chunks(stage)]


def lockstep_handlers(executor: Any) -> dict[S.Kind, Callable[[S.Action], None]]:
    """An ``executor.StageExecutor``'s transport handlers on the ring: each message staged on its link for the tick's
    one batch (``TICK`` issues it: ``StageLink.exchange``); the receives land where the compute reads them."""
    link = executor.link

    def recv_forward(action: S.Action) -> None:
        k, chunk = action.microbatch, action.chunk
        key = executor._link_key(k, executor.virtual_stage(chunk) - 1, executor.is_last)
        link.stage_receive(link.prev_rank, partial(executor._received.__setitem__, (chunk, k)), key)

    def send_forward(action: S.Action) -> None:
        k, chunk = action.microbatch, action.chunk
        key = executor._link_key(k, executor.virtual_stage(chunk), True)
        link.stage_send(link.next_rank, executor._to_send.pop((chunk, k)), key)

    def recv_backward(action: S.Action) -> None:
        key, like = (action.chunk, action.microbatch), executor._gradient_like((action.chunk, action.microbatch))
        into = partial(executor._grads_in.__setitem__, key)
        link.stage_receive(link.next_rank, into, like=like, dtype=executor.boundary_dtype)

    def send_backward(action: S.Action) -> None:
        link.stage_send(link.prev_rank, executor._to_send.pop((action.chunk, action.microbatch)))

    return {
        S.RECV_FORWARD: recv_forward,
        S.SEND_FORWARD: send_forward,
        S.RECV_BACKWARD: recv_backward,
        S.SEND_BACKWARD: send_backward,
    }
