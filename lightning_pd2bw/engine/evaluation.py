"""A stage's evaluation (or prediction): ``schedule.evaluation``'s actions run forward-only on the newest weights,
each microbatch through the stage's chunks (one, or interleaved 1F1B's), metrics on the last (virtual) stage, sent
to every stage at ``EVAL_RESULTS``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .comm.microbatch import join_microbatches, to_device
from .comm.transport import as_tuple, input_signature
from .schedules import schedule as S


@torch.no_grad()
def evaluate(
    executor: Any,
    microbatches: Sequence[Any],
    metrics_fn: Callable[[Any, Any], dict[str, torch.Tensor]],
    publish: Callable[[list[dict]], Any],
) -> Any:
    """``executor``'s stage (an ``executor.StageExecutor``) run forward-only over ``microbatches`` (see the module's
    docstring); what ``publish`` returns for the last stage's results (empty elsewhere) at ``EVAL_RESULTS``."""
    link, layout = executor.link, executor.layout
    executor.versions.use_latest()
    results: list[dict] = []
    values: dict[tuple[int, int], tuple] = {}  # (chunk, microbatch) -> what was received, then what was computed

    def key(action: S.Action, boundary: int) -> tuple:
        signature = ("eval", input_signature(microbatches[action.microbatch]))
        return signature if layout.virtual_stages == 1 else (*signature, boundary)  # a chunk's shapes are its own

    lockstep = layout.virtual_stages > 1  # the ring's messages staged for their tick (``lockstep.py``)

    def receive(action: S.Action) -> None:
        slot, boundary = (action.chunk, action.microbatch), executor.virtual_stage(action.chunk) - 1
        if lockstep:
            link.stage_receive(link.prev_rank, lambda tensors: values.__setitem__(slot, tensors), key(action, boundary))
            return
        values[slot] = tuple(link.recv_forward(key(action, boundary)))

    def run(action: S.Action) -> None:
        microbatch, chunk = microbatches[action.microbatch], action.chunk
        virtual = executor.virtual_stage(chunk)
        received = values.pop((chunk, action.microbatch)) if virtual > 0 else None
        inputs = as_tuple(executor.input_fn(microbatch)) if virtual == 0 else tuple(link.arrived(received))
        start, stop = executor.chunk_ranges[chunk]
        outputs = executor.run_layers(inputs, start, stop)
        if virtual == executor.num_virtual - 1:
            results.append(metrics_fn(outputs, microbatch))
        else:
            values[(chunk, action.microbatch)] = as_tuple(outputs)

    def send(action: S.Action) -> None:
        boundary = executor.virtual_stage(action.chunk)
        outputs = executor._wire(values.pop((action.chunk, action.microbatch)))
        if lockstep:
            link.stage_send(link.next_rank, outputs, key(action, boundary))
            return
        link.send_forward(outputs, key(action, boundary))
        link.settle(link.next_rank, keep=1)  # forward-only: the next stage needs nothing back

    published: list[Any] = []
    table = {S.RECV_FORWARD: receive, S.EVAL: run, S.SEND_FORWARD: send, S.TICK: lambda action: link.exchange()}
    table[S.WAIT_SENDS] = executor.handlers[S.WAIT_SENDS]
    table[S.EVAL_RESULTS] = lambda action: published.append(publish(results))
    actions = S.evaluation(executor.stage, layout.num_stages, len(microbatches), layout.virtual_stages)
    for action in actions:
        table[action.kind](action)
    executor.versions.rest()
    return published[0]


def means(results: list[dict]) -> dict[str, float]:
    """An evaluation's results: each metric's mean over the microbatches."""
    return {k: torch.stack([r[k].float() for r in results]).mean().item() for k in results[0]}


def on_host(results: list) -> Any:
    """A prediction's results: the microbatches' outputs joined along dimension 0, on the host."""
    return join_microbatches(to_device(results, torch.device("cpu")))
