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

Under mixed weights only the owners keep a parameter's float32 master (``versions.py``): the owners broadcast their
new weights in the compute dtype, straight into the others' newest version (half the bytes of float32).

The broadcasts run on a group of their own (``grid.Groups.shard``), asynchronously: launched at STEP, each owner's
tensors in turn (replica 0's first, the same order on every replica), each straight into the receivers' storage of
the new version (no buffer: a flat copy of every owner's bytes would hold a whole stage's weights again at once), and
waited for at PUBLISH, before the first forward that reads them (``stepper.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from ..comm.grid import ProcessGrid
from ..layout import sharded_at
from ..schedules import actions as A
from .collectives import Collective, CollectiveOp, GroupName


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

    # each owner's new weights to the others, launched at STEP, waited for at PUBLISH (``Stepper`` declares one
    # per owner)
    WEIGHTS: ClassVar = Collective(CollectiveOp.BROADCAST, GroupName.SHARD, "weights", A.STEP, A.PUBLISH)

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
        if not sharded_at(grid.data_parallel_size, enabled) or not optimizers:
            return None
        optimized = [p for optimizer in optimizers for group_ in optimizer.param_groups for p in group_["params"]]
        return cls.build(optimized, grid.replica, grid.replica_ranks(), group)

    @property
    def width(self) -> int:
        return len(self.ranks)

    def masters_kept(self, params: Sequence[nn.Parameter]) -> list[nn.Parameter]:
        """Of a stage's ``params``, those whose float32 master this replica keeps under mixed weights: its own and
        those no optimizer steps (every replica keeps theirs)."""
        others = {id(p) for r, owned in enumerate(self.by_owner) if r != self.replica for p in owned}
        return [p for p in params if id(p) not in others]

    def owned(self) -> list[nn.Parameter]:
        """This replica's parameters: the only ones its optimizers keep (``update.local_optimizers``)."""
        return self.by_owner[self.replica]

    @torch.no_grad()
    def launch_broadcasts(
        self, messages: Callable[[list[nn.Parameter]], list[torch.Tensor]] | None = None
    ) -> Callable[[], None]:
        """After the step, the parameters pointing at the weights it wrote: each owner's new weights to every other
        replica, tensor by tensor, asynchronously, into those storages (``messages``: the tensors that travel for
        ``params``, e.g. the newest weight version's in the compute dtype when only owners keep the float32 master;
        None: the parameters' own). Returns what waits for them all (and copies back a tensor that had to travel as
        a contiguous copy). Every replica holds the same owner lists, so all issue the same broadcasts in the same
        order."""
        works, copies = [], []
        tensors = dict(zip(map(id, self.params), messages(self.params))) if messages is not None else {}
        for owner, params in enumerate(self.by_owner):
            for param in params:
                target = tensors.get(id(param), param.data)
                message = target if target.is_contiguous() else target.contiguous()
                works.append(self.WEIGHTS.issue(message, self.group, root=self.ranks[owner]))
                if message is not target:
                    copies.append((target, message))

        def wait() -> None:
            for work in works:
                work.wait()
            for target, message in copies:
                target.copy_(message)

        return wait
