"""The collectives of a stage's update, declared as data and issued from their declaration.

A part of the update (``update.py``) declares each collective it issues for a batch (``UpdatePart.collectives``):
its op, its communicator, the action issuing it and the one waiting for it. The NCCL lowering
(``verify/comm_plan.py``) and the planner's simulator read the declarations; the part issues the collective through
the same object (``Collective.issue``), so the op, its reduction and its root are the declaration's by construction.
The recorded-trace tests (``tests/distributed/test_nccl_traces.py``) check the order and the groups as well.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from ..layout import Word
from ..schedules import actions as A


class CollectiveOp(Word):
    ALL_REDUCE = "all_reduce"
    REDUCE = "reduce"  # to each owner in turn (sharded gradients)
    BROADCAST = "broadcast"


class GroupName(Word):
    """A stage's communicators (``grid.Groups``); ``TIED``: the stages holding a tied parameter (``Groups.shared``)."""

    REPLICA = "replica"
    SHARD = "shard"
    PIPELINE = "pipeline"
    TIED = "tied"


@dataclass(frozen=True)
class Collective:
    """One collective an update part issues for every batch, as data. ``issued``: the action issuing it (BACKWARD:
    during the batch's last backward on the stage); ``waited``: the action of the same batch that waits for it
    (None: waited in the action issuing it). ``group``: the stage's communicator (``grid.Groups``: ``replica``,
    ``pipeline``, ``shard``, or ``tied``, the stages holding the tied parameter). ``repeat``: issued that many times
    in a row (one per bucket, per bucket and owner). ``maximum``: a reduction's max (flags) instead of its sum."""

    op: CollectiveOp
    group: GroupName
    what: str
    issued: A.Kind
    waited: A.Kind | None = None
    repeat: int = 1
    # the next batch's first backward on the stage waits for it, if still in flight (it reads the buffer that
    # backward accumulates into: the sharded gradients' one bucket set under 2BW, ``grad_buckets.py``)
    reclaimed: bool = False
    maximum: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "op", CollectiveOp(self.op))
        object.__setattr__(self, "group", GroupName(self.group))

    def times(self, repeat: int, **changes: Any) -> Collective:
        """The same collective issued ``repeat`` times in a row (e.g. once per bucket)."""
        return replace(self, repeat=repeat, **changes)

    def issue(self, tensor: torch.Tensor, group: Any, *, root: int | None = None) -> Any:
        """Issue one of this collective on ``tensor`` over ``group`` (the communicator ``self.group`` names), as
        declared: its op and reduction, asynchronously; ``root``: the global rank a reduce goes to or a broadcast
        comes from. Returns the work to wait for, at ``waited`` (None: before the issuing action ends)."""
        if self.op is CollectiveOp.ALL_REDUCE:
            reduction = dist.ReduceOp.MAX if self.maximum else dist.ReduceOp.SUM
            return dist.all_reduce(tensor, op=reduction, group=group, async_op=True)
        if root is None:
            raise ValueError(f"{self.what}: a {self.op.value} needs its root rank")
        if self.op is CollectiveOp.REDUCE:
            reduction = dist.ReduceOp.MAX if self.maximum else dist.ReduceOp.SUM
            return dist.reduce(tensor, dst=root, op=reduction, group=group, async_op=True)
        return dist.broadcast(tensor, src=root, group=group, async_op=True)
