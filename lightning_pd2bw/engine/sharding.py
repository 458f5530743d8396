"""The optimizer sharded over a stage's replicas (ZeRO-1, as Megatron's distributed optimizer and torch's
``ZeroRedundancyOptimizer`` shard it): each parameter of the stage is owned by one replica, which alone holds its
optimizer state and delay-correction buffers and runs its step; after the step each owner broadcasts its new
weights to the other replicas, into their newest weight version.

Ownership is by whole tensors (Muon's Newton-Schulz needs the whole matrix), balanced by size: the largest first,
each to the replica owning the fewest elements so far (ties: the lowest replica), so every replica computes the
same assignment from the same parameter list, with no communication. By default the gradients stay all-reduced
(every replica holds the averaged gradient of every parameter: Lightning's ``on_before_optimizer_step`` hooks, the
global clip norm and the non-finite check read them unchanged); what the sharding saves is the optimizer's state,
the correction's buffers and 1/w of the step's work, and the rule is exactly the unsharded one (one replica
computes what all of them computed before). ``shard_gradients=True`` reduces each gradient to its owner instead
(``grad_buckets.py``; the norm and the flags then sum the owners' parts over the replicas, ``update.py``): the
exchange drops from all-reduce plus broadcast to DDP's bytes.

The broadcasts run on a group of their own (``grid.Groups.shard``), one per owning replica, each the bytes of the
owner's parameters in one message (``gradients.broadcast_flat``, any dtypes); every replica issues them in the same
order (replica 0 first).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from . import gradients
from .grid import ProcessGrid


def assign_owners(params: Sequence[nn.Parameter], width: int) -> list[int]:
    """The replica owning each parameter: whole tensors, the largest first, each to the least-loaded replica."""
    return owners_of([p.numel() for p in params], width)[0]


def owners_of(sizes: Sequence[int], width: int) -> tuple[list[int], list[int]]:
    """(the owner of each tensor of ``sizes`` elements, each replica's load): ``assign_owners`` on sizes alone (the
    planner's view: the fullest replica holds more than 1/w where one tensor is large, e.g. an embedding)."""
    load = [0] * width
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        replica = min(range(width), key=lambda r: (load[r], r))
        owners[index] = replica
        load[replica] += sizes[index]
    return owners, load


@dataclass
class OptimizerShards:
    """The stage's optimized parameters, their owners, and how the owners' new weights reach the other replicas."""

    params: list[nn.Parameter]  # every parameter the stage's optimizers step, in order
    owners: list[int]  # the replica owning each
    replica: int  # this rank's replica
    ranks: list[int]  # each replica's global rank on this stage (the broadcasts' sources)
    group: object  # grid.Groups.shard
    by_owner: list[list[nn.Parameter]] = field(init=False)  # each replica's parameters, in order

    def __post_init__(self) -> None:
        self.by_owner = [[p for p, o in zip(self.params, self.owners) if o == r] for r in range(len(self.ranks))]

    @classmethod
    def build(
        cls, params: Sequence[nn.Parameter], replica: int, ranks: Sequence[int], group: object
    ) -> OptimizerShards:
        params = list(params)
        return cls(params, assign_owners(params, len(ranks)), replica, list(ranks), group)

    @classmethod
    def over(
        cls, optimizers: Sequence[torch.optim.Optimizer], grid: ProcessGrid, group: object, enabled: bool = True
    ) -> OptimizerShards | None:
        """The shards of what ``optimizers`` step on this stage, over its replicas (None: width 1, no optimizer,
        or not ``enabled``)."""
        if not enabled or grid.data_parallel_size == 1 or not optimizers:
            return None
        optimized = [p for optimizer in optimizers for group_ in optimizer.param_groups for p in group_["params"]]
        return cls.build(optimized, grid.replica, grid.replica_ranks(), group)

    @property
    def width(self) -> int:
        return len(self.ranks)

    def owned(self) -> list[nn.Parameter]:
        """This replica's parameters: the only ones its optimizers keep (``update.local_optimizers``)."""
        return self.by_owner[self.replica]

    @torch.no_grad()
    def broadcast_weights(self) -> None:
        """After the step: each owner's new weights to every other replica, one message of their bytes per owner
        (``gradients.broadcast_flat``), into the weight version the step wrote (the parameters' current storage).
        Every replica holds the same owner lists, so an owner with nothing skips its broadcast everywhere."""
        for owner, params in enumerate(self.by_owner):
            gradients.broadcast_flat([p.data for p in params], self.ranks[owner], self.group)
