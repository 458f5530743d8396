"""Building one stage from the whole model's layers: cut, release other stages' layers, materialise and
initialise this stage's, place them, create the process groups, and make replicas and tied weights start equal."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .comm.grid import Groups, ProcessGrid, build_groups
from .layout import Layout
from .materialize import check_initialized, initialize_layers, materialize, release, unwritten
from .partition import shared_parameters
from .schedules import program
from .schedules import schedule as S
from .updates import gradients
from .updates.update import TiedParameter


@dataclass
class Stage:
    stage_layers: list[range]  # every (virtual) stage's layer indices (``Layout.cut``)
    layers: list[nn.Module]  # this stage's
    params: list[nn.Parameter]  # this stage's own (a tied one once)
    groups: Groups
    shared: list[TiedParameter]  # this stage's parameters that other stages hold too


def build_stage(
    layers: Sequence[nn.Module],
    layout: Layout,
    grid: ProcessGrid,
    device: torch.device,
    init_layer: Callable[[int], None] | None,
    root: nn.Module | None,
    split_groups: bool | None = None,
) -> Stage:
    layers = list(layers)
    stage_layers = layout.cut(layers)
    # each stage's layers: its chunks' (one a stage, or interleaved 1F1B's virtual stages s, s + d, ...)
    held = [[i for v in layout.chunks(s) for i in stage_layers[v]] for s in range(layout.num_stages)]
    mine = held[grid.stage]
    shared = shared_parameters(layers, held)
    local = [layers[i] for i in mine]
    kept = set(mine)
    for index, layer in enumerate(layers):
        if index not in kept:
            release(layer)
    materialized = materialize(local, device)
    if materialized:
        initialize_layers(layers, mine, root if root is not None else nn.ModuleList(layers), init_layer)
    for layer in local:
        layer._apply(lambda t: t if t.is_meta else t.to(device))
    ring = layout.virtual_stages > 1  # the last stage sends on to the first
    groups = build_groups(grid, [s.stages for s in shared], split=split_groups, ring=ring)  # split None: as allowed
    tied = _tied_on_stage(layers, shared, grid, groups)
    holders = [s.stages for s in shared if grid.stage in s.stages]

    def replicas(action: S.Action) -> None:  # every replica starts from replica 0's weights and buffers (as DDP)
        tensors = list(dict.fromkeys(t for layer in local for t in (*layer.parameters(), *layer.buffers())))
        gradients.broadcast_flat(tensors, grid.replica_ranks()[0], groups.replica)

    def tied_copies(action: S.Action) -> None:  # the first stage whose copy was initialised broadcasts it
        item = tied[action.batch]
        source = _initialised_copy(item, holders[action.batch], grid) if materialized else item.source
        dist.broadcast(item.param.data, src=source, group=item.group)

    table = {S.SETUP_REPLICAS: replicas, S.SETUP_TIED: tied_copies}
    with torch.no_grad():
        for action in program.setup(grid.data_parallel_size, len(tied)):  # the NCCL model lowers the same list
            table[action.kind](action)
    if materialized:
        check_initialized(layers, mine, by_init_layer=init_layer is not None)
    params = list(dict.fromkeys(p for layer in local for p in layer.parameters()))
    return Stage(stage_layers, local, params, groups, tied)


def _initialised_copy(item: TiedParameter, stages: tuple[int, ...], grid: ProcessGrid) -> int:
    """The global rank of the first stage holding ``item`` whose copy its initialisation wrote (a model may
    initialise a tied weight from the layer on the last stage and skip it on the first: torchtitan's tied output);
    an error naming it when no stage's copy was written."""
    written = torch.zeros(len(stages), device=item.param.device)
    written[stages.index(grid.stage)] = float(not unwritten({"tied": item.param.data}))
    dist.all_reduce(written, group=item.group)
    holders = [stage for stage, flag in zip(stages, written.tolist()) if flag > 0]
    if not holders:
        raise RuntimeError(
            f"pd2bw: a parameter tied across stages {list(stages)} (shape {tuple(item.param.shape)}) was initialised "
            "by none of them after the model was built on the meta device. Give the module that owns it a "
            "reset_parameters(), or define init_pipeline_layer(self, index) to initialise it (docs/models.md)"
        )
    return grid.rank_of(holders[0])


def _tied_on_stage(
    layers: list[nn.Module], shared: list[Any], grid: ProcessGrid, groups: Groups
) -> list[TiedParameter]:
    out = []
    for item in shared:
        if grid.stage not in item.stages:
            continue
        index, name = item.location_on(grid.stage)
        param = dict(layers[index].named_parameters(remove_duplicate=False))[name]
        first = item.stages[0]
        out.append(TiedParameter(param, groups.shared[item.stages], grid.rank_of(first), grid.stage == first))
    return out
