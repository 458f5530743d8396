"""A stage's replicated gradients in flat buckets, all-reduced while the batch's last backward still runs.

As DDP (``gradient_as_bucket_view``) and Megatron (its contiguous gradient buffer) do: each parameter's ``.grad``
is a view into a flat bucket, so autograd accumulates every microbatch's gradient in place and the all-reduce
runs on the bucket itself, with no second copy of the gradients. Buckets hold the parameters in reverse order
(the backward produces the last layers' gradients first). During the batch's last backward on this stage
(``arm``), a bucket's all-reduce starts as soon as its last gradient is accumulated, and buckets start in
bucket order on every replica (collectives of one group must be issued alike everywhere). The update's REDUCE
calls ``launch``: the buckets not started yet start, and they are handed over still in flight; under 2BW the next
batch accumulates into a second set (one more gradient buffer, no copy), so the all-reduce finishes behind the next
batch's compute. CHECK calls ``complete``, which waits and divides by the width (``update_parts.BucketReducer``).

A parameter that gets no gradient in a batch on any replica keeps ``grad=None``, as in single-device training
(an optimizer skips it): each bucket carries one flag per parameter, set where the gradient arrived and summed
with the gradients; ``complete`` reads the flags only on a replica that missed a gradient (a host sync in that
case alone). At width 1 the buckets serve mixed-precision weights (``versions.py``) alone: float32 gradients
kept attached to bfloat16 versions, with no collective. Parameters held by several stages (a tied embedding) are
not in the buckets: 2BW moves their gradients aside for their sums over the stages (``update.py``, REDUCE).

Sharded gradients (``shards``: ``PipelineOptions.shard_gradients``, with the optimizer sharded): within a bucket
each owner's parameters lie together, their flags beside them, and each owner's part is reduced to its owner
(``dist.reduce``) instead of all-reduced: with the owners' weight broadcast after the step, each replica moves what
DDP's all-reduce alone moves (ZeRO-1's exchange) instead of an all-reduce plus that broadcast. Only the owner then
holds the average; elsewhere the parameter's gradient is None for the update (a parameter no optimizer steps has no
owner and stays all-reduced). Under 2BW sharded buckets keep one set, not two: the next batch's first gradient into a
bucket (or CHECK, if first) waits for its reduces, copies this replica's segments out as the batch's set-aside and
zeroes it (``_hand_over``; the lowering's ``Collective.reclaimed``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from ..schedules import actions as A
from .collectives import Collective, CollectiveOp, GroupName
from .gradients import buckets as group_in_buckets
from .gradients import replica_bucket_bytes

if TYPE_CHECKING:
    from .sharding import OptimizerShards

_HOOKS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> its hook's handle (the newest owner's)


def release(params: Sequence[nn.Parameter]) -> None:
    """Remove any bucket hooks from ``params`` (an engine rebuilt over them without replicas)."""
    for param in params:
        handle = _HOOKS.pop(param, None)
        if handle is not None:
            handle.remove()


class _CastBack:
    """A segment's collective run on a copy in ``grad_reduce_dtype``: once it is done, the result is cast back into
    the float32 segment where this replica receives it (the owner, or every replica for an all-reduce)."""

    def __init__(self, work: Any, message: torch.Tensor, part: torch.Tensor, receives: bool) -> None:
        self.work, self.message, self.part, self.receives = work, message, part, receives

    def wait(self) -> None:
        self.work.wait()
        if self.receives:
            self.part.copy_(self.message)


class _Done:
    """A bucket's all-reduce at width 1: nothing to wait for."""

    @staticmethod
    def wait() -> None:
        return None


_DONE = _Done()


ALL = -1  # a segment all-reduced (not sharded, or a parameter no replica owns)


@dataclass
class _Bucket:
    params: list[nn.Parameter]  # each owner's together (``_new_bucket``)
    flat: torch.Tensor  # per segment: its gradients, then one flag per parameter
    views: list[torch.Tensor]
    flag_at: torch.Tensor  # each parameter's flag: its index in ``flat``
    segments: list[tuple[int, torch.Tensor]]  # (owner replica or ALL, its part of ``flat``)
    positions: list[list[int]]  # each segment's parameters, as positions in ``params``
    waiting: int = 0  # gradients still to arrive in the armed backward
    work: list[Any] | None = None  # its collectives, once started
    # sharded under 2BW: the launched batch's reduces still read ``flat``, which the next batch accumulates into once
    # they are done and this replica's segments are copied out (``kept``: the owner's share of the set-aside)
    handing_over: bool = False
    kept: dict[int, torch.Tensor] | None = None  # position -> its averaged gradient, a view of the kept copy
    kept_flags: tuple[torch.Tensor, dict[int, int]] | None = None  # the kept copy, each position's flag index in it

    def flags(self) -> list[float]:
        return self.flat[self.flag_at].tolist()  # a host sync: read only where a gradient was missed


def _new_bucket(params: list[nn.Parameter], dtype: torch.dtype, owner_of: dict[int, int] | None = None) -> _Bucket:
    def owner(param: nn.Parameter) -> int:
        return ALL if owner_of is None else owner_of.get(id(param), ALL)

    params = sorted(params, key=owner)  # stable: the same layout on every replica
    flat = torch.zeros(sum(p.numel() for p in params) + len(params), dtype=dtype, device=params[0].device)
    views: list[torch.Tensor] = []
    flag_at: list[int] = []
    segments: list[tuple[int, torch.Tensor]] = []
    positions: list[list[int]] = []
    offset = 0
    for key, members in itertools.groupby(params, key=owner):
        members = list(members)
        positions.append(list(range(len(views), len(views) + len(members))))
        start = offset
        for param in members:
            views.append(flat[offset : offset + param.numel()].view_as(param))
            offset += param.numel()
        flag_at += range(offset, offset + len(members))
        offset += len(members)
        segments.append((key, flat[start:offset]))
    index = torch.tensor(flag_at, dtype=torch.long, device=flat.device)
    return _Bucket(params, flat, views, index, segments, positions)


@dataclass
class Launched:
    """One batch's buckets, their all-reduces in flight (``GradientBuckets.launch``)."""

    buckets: list[_Bucket]
    arrived: set[int]
    compact: bool = False  # sharded under 2BW: the one set, each bucket's share kept at its hand-over


@dataclass
class GradientBuckets:
    """Replica averaging of ``params``' gradients over ``group`` (``size`` replicas), overlapped with the
    backward. Build it once per stage; ``zero`` replaces the optimizers' ``zero_grad``."""

    params: Sequence[nn.Parameter]
    group: Any
    size: int
    limit: int | None = None  # bytes per bucket (default: ``gradients.replica_bucket_bytes``, Megatron-LM's)
    shards: OptimizerShards | None = None  # sharded gradients: each owner's part reduced to it alone
    # the gradients' dtype (mixed weights: float32, whatever dtype a parameter points at here); None: each one's own
    dtype: torch.dtype | None = None
    # the dtype the sums over the replicas travel in (``PipelineOptions.grad_reduce_dtype``); None: the buckets' own
    reduce_dtype: torch.dtype | None = None
    buckets: list[_Bucket] = field(default_factory=list)

    # what each bucket issues over the replicas during the batch's last backward, waited for at CHECK (the reducer,
    # ``update_parts.BucketReducer``, declares them, once per bucket or per bucket and owner)
    ALL_REDUCE: ClassVar = Collective(
        CollectiveOp.ALL_REDUCE, GroupName.REPLICA, "replica average", A.BACKWARD, A.CHECK
    )
    TO_OWNER: ClassVar = Collective(CollectiveOp.REDUCE, GroupName.REPLICA, "replica average", A.BACKWARD, A.CHECK)

    def __post_init__(self) -> None:
        order = [p for p in reversed(list(self.params)) if p.requires_grad]
        itemsize = (self.dtype or (order[0].dtype if order else torch.float32)).itemsize
        limit = self.limit or replica_bucket_bytes(self.size, itemsize)
        groups = group_in_buckets(order, limit=limit, dtype=self.dtype)
        shards = self.shards
        self._owner_of = None if shards is None else {id(p): o for p, o in zip(shards.params, shards.owners)}
        self._slot: dict[int, tuple[int, int]] = {}  # id(parameter) -> (bucket index, position), in either set
        self._handles: list[tuple[nn.Parameter, Any]] = []
        self._spare: list[_Bucket] | None = None  # the second set, allocated at 2BW's first launch
        self._sets = 1
        for index, params in enumerate(groups):
            self.buckets.append(_new_bucket(params, self.dtype or params[0].dtype, self._owner_of))
            for position, param in enumerate(self.buckets[-1].params):
                self._slot[id(param)] = (index, position)
                release([param])  # a rebuilt engine over the same parameters takes them over
                _HOOKS[param] = param.register_post_accumulate_grad_hook(self._accumulated)
                self._handles.append((param, _HOOKS[param]))
        self.arrived: set[int] = set()  # id(parameter) with a gradient in this batch, on this replica
        self.armed = False
        self.held = False
        self._next = 0  # the next bucket to start
        self.attach()

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    @property
    def sharded(self) -> bool:
        """Whether a replica holds the average of its own parameters' gradients only (``shards``)."""
        return self._owner_of is not None and self.size > 1

    def holds(self, param: nn.Parameter) -> bool:
        """Whether this replica receives ``param``'s averaged gradient (every parameter unless ``sharded``)."""
        if not self.sharded:
            return True
        return self._owner_of.get(id(param), ALL) in (ALL, self.shards.replica)

    @property
    def held_bytes(self) -> int:
        """Bytes of every bucket set allocated: one, and 2BW's second from its first launch."""
        one_set = sum(b.flat.numel() * b.flat.element_size() for b in self.buckets)
        return one_set * self._sets

    def attach(self) -> None:
        """Point every ``.grad`` at its view (after anything that set them to None or replaced them); a bucket still
        handed over to the previous batch's update is attached at its first gradient (``_accumulated``)."""
        for bucket in self.buckets:
            if bucket.handing_over:
                continue
            for param, view in zip(bucket.params, bucket.views):
                self._adopt(param, view)

    @staticmethod
    def _adopt(param: nn.Parameter, view: torch.Tensor) -> None:
        grad = param.grad
        if grad is view:
            return
        if grad is not None:  # a gradient set aside the bucket (sparse ones, e.g. nn.Embedding(sparse=True), too)
            view.zero_().add_(grad) if grad.layout != torch.strided else view.copy_(grad)
        param.grad = view

    def arm(self, hold: bool = False) -> None:
        """The batch's last backward on this stage begins: start each bucket once its gradients are in. ``hold``: a
        split backward (ZB-H1), whose deferred weight gradients arrive in its W passes: count, start at ``release``."""
        self.armed = True
        self.held = hold
        for bucket in self.buckets:
            bucket.waiting = len(bucket.params)

    def release(self) -> None:
        """The batch's last W is done, every gradient final: start the complete buckets, in bucket order."""
        self.held = False
        while self._next < len(self.buckets) and self.buckets[self._next].waiting <= 0:
            self._start(self.buckets[self._next])

    def _accumulated(self, param: nn.Parameter) -> None:
        index, position = self._slot[id(param)]
        bucket = self.buckets[index]
        if bucket.handing_over:  # the previous batch's reduce still owns it: wait, keep this replica's share
            self._hand_over(bucket)
        self._adopt(param, bucket.views[position])
        self.arrived.add(id(param))
        if not self.armed or bucket.work is not None:
            return
        bucket.waiting -= 1
        if self.held:
            return
        while self._next < len(self.buckets) and self.buckets[self._next].waiting == 0:
            self._start(self.buckets[self._next])

    def _start(self, bucket: _Bucket) -> None:
        if bucket.handing_over:  # no gradient of this batch reached it: the previous batch's share is taken now
            self._hand_over(bucket)
        arrived = [id(p) in self.arrived for p in bucket.params]
        if all(arrived):
            bucket.flat.index_fill_(0, bucket.flag_at, 1)
        elif any(arrived):
            positions = torch.tensor([i for i, flag in enumerate(arrived) if flag], device=bucket.flag_at.device)
            bucket.flat.index_fill_(0, bucket.flag_at[positions], 1)
        bucket.work = [self._collective(owner, part) for owner, part in bucket.segments] if self.size > 1 else [_DONE]
        self._next += 1

    def _collective(self, owner: int, part: torch.Tensor) -> Any:
        """A segment's sum over the replicas: to its owner alone (sharded), else to every replica; in
        ``reduce_dtype`` on a cast copy where that differs from the bucket's (cast back when waited for)."""
        cast = self.reduce_dtype is not None and self.reduce_dtype != part.dtype
        message = part.to(self.reduce_dtype) if cast else part
        if owner == ALL:
            work = self.ALL_REDUCE.issue(message, self.group)
        else:
            work = self.TO_OWNER.issue(message, self.group, root=self.shards.ranks[owner])
        return _CastBack(work, message, part, owner == ALL or owner == self.shards.replica) if cast else work

    def _wait(self, bucket: _Bucket, missed: bool) -> list[float]:
        """Wait for ``bucket``'s collectives and average; its flags (read only where a gradient was missed)."""
        for work in bucket.work:
            work.wait()
        bucket.work = None
        if self.size > 1:
            bucket.flat.div_(self.size)  # a non-owner's part of another owner is left as it was: never read
        return bucket.flags() if missed else [1.0] * len(bucket.params)

    def _hand_over(self, bucket: _Bucket) -> None:
        """Sharded under 2BW: wait for ``bucket``'s reduces, copy this replica's segments (its own parameters' and
        those no replica owns) out of it, averaged, with their flags, and zero it for the next batch."""
        for work in bucket.work or []:
            work.wait()
        bucket.work = None
        mine = (ALL, self.shards.replica)
        ours = [(part, at) for (owner, part), at in zip(bucket.segments, bucket.positions) if owner in mine]
        copy = torch.cat([part for part, _ in ours]) if ours else bucket.flat[:0].clone()
        copy.div_(self.size)
        kept, flag_at, offset = {}, {}, 0
        for _, at in ours:  # a segment: its gradients, then one flag per parameter (``_new_bucket``)
            for position in at:
                numel = bucket.params[position].numel()
                kept[position] = copy[offset : offset + numel].view_as(bucket.params[position])
                offset += numel
            flag_at.update({position: offset + i for i, position in enumerate(at)})
            offset += len(at)
        bucket.kept, bucket.kept_flags = kept, (copy, flag_at)
        bucket.flat.zero_()
        bucket.handing_over = False

    def launch(self, double_buffered: bool = True) -> Launched:
        """REDUCE: start what has not started and hand the buckets over in flight (``complete`` waits).

        2BW (``double_buffered``): the next batch's gradients accumulate meanwhile into the other set, zeroed, its
        views attached. Flush and gpipe finish the update before the next batch computes: the one set is handed
        over, the ``.grad`` detached, and ``zero()`` after the step makes it the next batch's (no second set)."""
        while self._next < len(self.buckets):
            self._start(self.buckets[self._next])
        compact = double_buffered and self.sharded
        launched = Launched(self.buckets, set(self.arrived), compact)
        if compact:  # one set: each bucket handed over when the next batch first needs it (or at CHECK)
            for bucket in self.buckets:
                assert bucket.kept is None, "a batch's share was not taken at its CHECK before the next REDUCE"
                bucket.handing_over = True
        elif double_buffered:
            if self._spare is None:
                self._spare = [_new_bucket(b.params, b.flat.dtype, self._owner_of) for b in self.buckets]
                self._sets = 2
            self.buckets, self._spare = self._spare, None
            for bucket in self.buckets:
                bucket.flat.zero_()
                bucket.work = None
        for bucket in self.buckets:
            for param in bucket.params:
                param.grad = None  # the launched views stay with the update: attach() must not copy them over
        self.arrived = set()
        self.armed = self.held = False
        self._next = 0
        if double_buffered and not compact:
            self.attach()
        return launched

    def complete(self, launched: Launched) -> dict[int, torch.Tensor | None]:
        """CHECK: wait for ``launched``'s all-reduces and average; returns each parameter's gradient (a view of
        its bucket; None where no replica had one, and, sharded, where another replica owns it). The set is the spare again once the update is done with it."""
        missed = len(launched.arrived) < len(self._slot)
        out: dict[int, torch.Tensor | None] = {}
        if launched.compact:
            for bucket in launched.buckets:
                out.update(self._take_kept(bucket, missed))
            return out
        for bucket in launched.buckets:
            for param, view, flag in zip(bucket.params, bucket.views, self._wait(bucket, missed)):
                out[id(param)] = view if flag and self.holds(param) else None
        if launched.buckets is not self.buckets:  # 2BW: the spare set again once the update is done with it
            self._spare = launched.buckets
        return out

    def _take_kept(self, bucket: _Bucket, missed: bool) -> dict[int, torch.Tensor | None]:
        """CHECK, sharded under 2BW: ``bucket``'s kept share (handed over now if the next batch has not yet)."""
        if bucket.handing_over:
            self._hand_over(bucket)
        assert bucket.kept is not None and bucket.kept_flags is not None
        kept, (copy, flag_at) = bucket.kept, bucket.kept_flags
        flags = dict(zip(flag_at, copy[list(flag_at.values())].tolist())) if missed and flag_at else {}
        bucket.kept = bucket.kept_flags = None  # the update holds them now
        return {
            id(param): kept[i] if i in kept and (not missed or flags.get(i)) else None
            for i, param in enumerate(bucket.params)
        }

    def kept_bytes(self) -> int:
        """Sharded under 2BW: the bytes of this replica's share of one bucket set (what a batch's set-aside keeps)."""
        mine = (ALL, self.shards.replica) if self.shards is not None else (ALL,)
        return sum(part.numel() * part.element_size() for b in self.buckets for o, part in b.segments if o in mine)

    def zero(self) -> None:
        """After a step: zero the buckets and point every ``.grad`` at its view again."""
        for bucket in self.buckets:
            bucket.flat.zero_()
        self.arrived.clear()
        self.attach()

    def close(self) -> None:
        """Remove the hooks (the parameters' gradients stay as they are)."""
        for param, handle in self._handles:
            handle.remove()
            if _HOOKS.get(param) is handle:
                del _HOOKS[param]
        self._handles.clear()
