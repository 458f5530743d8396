"""The optimizer sharded over a stage's replicas (ZeRO-1, as Megatron's distributed optimizer and torch's
``ZeroRedundancyOptimizer`` shard it): each parameter of the stage is owned by one replica, which alone holds its
optimizer state and delay-correction buffers and runs its step; after the step each owner broadcasts its new
weights to the other replicas, into their newest weight version.

Ownership is by whole tensors (Muon's Newton-Schulz needs the whole matrix), balanced by size: the largest first,
each to the replica owning the fewest elements so far (ties: the lowest replica), so every replica computes the
same assignment from the same parameter list, with no communication. The gradients stay all-reduced (every
replica holds the averaged gradient of every parameter: the global clip norm and the non-finite check read them
unchanged); what the sharding saves is the optimizer's state, the correction's buffers and 1/w of the step's
work, and the rule is exactly the unsharded one (one replica computes what all of them computed before).

The broadcasts run on a group of their own (``grid.Groups.shard``), one per replica and dtype, each over the
owner's parameters flattened into one buffer; every replica issues them in the same order (replica 0 first).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .grid import ProcessGrid


def assign_owners(params: Sequence[nn.Parameter], width: int) -> list[int]:
    """The replica owning each parameter: whole tensors, the largest first, each to the least-loaded replica."""
    load = [0] * width
    owners = [0] * len(params)
    for index in sorted(range(len(params)), key=lambda i: (-params[i].numel(), i)):
        replica = min(range(width), key=lambda r: (load[r], r))
        owners[index] = replica
        load[replica] += params[index].numel()
    return owners


@dataclass
class OptimizerShards:
    """The stage's optimized parameters, their owners, and how the owners' new weights reach the other replicas."""

    params: list[nn.Parameter]  # every parameter the stage's optimizers step, in order
    owners: list[int]  # the replica owning each
    replica: int  # this rank's replica
    ranks: list[int]  # each replica's global rank on this stage (the broadcasts' sources)
    group: object  # grid.Groups.shard

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
        return [p for p, owner in zip(self.params, self.owners) if owner == self.replica]

    def buckets(self) -> list[tuple[int, list[nn.Parameter]]]:
        """(owner, its parameters of one dtype and device), in the order every replica broadcasts them."""
        kinds = sorted({(str(p.dtype), str(p.device)) for p in self.params})
        out = []
        for owner in range(self.width):
            for kind in kinds:
                mine = [
                    p for p, o in zip(self.params, self.owners) if o == owner and (str(p.dtype), str(p.device)) == kind
                ]
                if mine:
                    out.append((owner, mine))
        return out

    @torch.no_grad()
    def broadcast_weights(self) -> None:
        """After the step: each owner's new weights to every other replica (into the weight version the step
        wrote: the parameters' current storage)."""
        for owner, params in self.buckets():
            if owner == self.replica:
                flat = _flatten_dense_tensors([p.data for p in params])
            else:
                flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
            dist.broadcast(flat, src=self.ranks[owner], group=self.group)  # type: ignore[arg-type]
            if owner != self.replica:
                for param, value in zip(params, _unflatten_dense_tensors(flat, [p.data for p in params])):
                    param.data.copy_(value)

    def held_fraction(self) -> float:
        """This replica's share of the optimized elements."""
        total = sum(p.numel() for p in self.params)
        return sum(p.numel() for p in self.owned()) / total if total else 1.0
