"""Gradient collectives of one pipeline update: replica averaging, shared-parameter sums, clipping (and the
broadcast that starts every replica of a stage from the same weights).

Plain torch.distributed (no Lightning). Run at a STEP action, in the same order on every stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

BUCKET_BYTES = 25 * 1024**2  # as DDP: few large messages instead of one per tensor


def buckets(tensors: Sequence[torch.Tensor], limit: int = BUCKET_BYTES) -> list[list[torch.Tensor]]:
    """Consecutive tensors grouped by dtype and device into buckets of at most ``limit`` bytes (or one tensor)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        last = out[-1] if out else None
        if last and last[0].dtype == tensor.dtype and last[0].device == tensor.device and size + nbytes <= limit:
            last.append(tensor)
            size += nbytes
        else:
            out.append([tensor])
            size = nbytes
    return out


def average_over_replicas(params: Sequence[nn.Parameter], group: Any, size: int) -> None:
    """Average gradients over the data-parallel replicas of this stage: flattened buckets, all-reduced
    asynchronously, then divided and copied back (element-wise the same sums as one call per tensor).

    At most two buckets are flattened at a time (the next one's all-reduce runs while the previous is
    copied back), so the extra memory is two buckets, not a second copy of every gradient."""
    if size <= 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    in_flight: list[tuple[list[torch.Tensor], torch.Tensor, Any]] = []

    def finish(bucket: list[torch.Tensor], buffer: torch.Tensor, work: Any) -> None:
        work.wait()
        buffer.div_(size)
        torch._foreach_copy_(bucket, torch._utils._unflatten_dense_tensors(buffer, bucket))

    for bucket in buckets(grads):
        buffer = torch._utils._flatten_dense_tensors(bucket)
        in_flight.append((bucket, buffer, dist.all_reduce(buffer, group=group, async_op=True)))
        if len(in_flight) > 1:
            finish(*in_flight.pop(0))
    for entry in in_flight:
        finish(*entry)


def all_finite(params: Sequence[nn.Parameter]) -> bool:
    """Whether every gradient entry is finite (one device sync)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return True
    return bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())


def sum_shared(shared: Sequence[tuple[nn.Parameter, Any]]) -> None:
    """A parameter held by several stages (a tied embedding) gets the sum of their gradients on each."""
    for param, group in shared:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad, group=group)


class DeferredSharedSums:
    """2BW's tied-parameter sums, off the critical path.

    The stages holding a tied parameter reach the update of batch b at different moments (the last
    stage first), so a blocking sum makes the early ones wait. Under 2BW, batch b's update is first
    read by batch b+2's forwards; ``launch`` therefore moves the tied gradients aside (the next
    batch's backwards start fresh ones: one extra gradient copy of the tied parameters) and sums them
    asynchronously; the caller applies them with ``take`` before batch b+2 begins.
    """

    def __init__(self) -> None:
        self.pending: dict[int, list[tuple[nn.Parameter, torch.Tensor, Any]]] = {}

    def launch(self, batch: int, shared: Sequence[tuple[nn.Parameter, Any]]) -> None:
        entries = []
        for param, group in shared:
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            param.grad = None
            entries.append((param, grad, dist.all_reduce(grad, group=group, async_op=True)))
        self.pending[batch] = entries

    def batches_until(self, batch: int) -> list[int]:
        return sorted(b for b in self.pending if b <= batch)

    def take(self, batch: int) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """Batch ``batch``'s summed gradients (waits for the sums)."""
        out = []
        for param, grad, work in self.pending.pop(batch):
            work.wait()
            out.append((param, grad))
        return out


def clip_by_norm(
    params: Sequence[nn.Parameter],
    max_norm: float,
    not_counted: set[int],
    group: Any | None,
    device: torch.device,
) -> None:
    """Clip by the global L2 norm: this stage's squares (shared parameters counted on one stage only,
    ``not_counted`` holds the others' ids) summed over ``group`` (None: this stage's norm alone)."""
    counted = [p.grad for p in params if p.grad is not None and id(p) not in not_counted]
    squares = torch.zeros((), device=device, dtype=torch.float32)
    for group_grads in _by_dtype(counted):  # one fused norm kernel per dtype, no loop over tensors
        squares += torch.stack(torch._foreach_norm(group_grads)).float().pow(2).sum()
    if group is not None:
        dist.all_reduce(squares, group=group)
    coefficient = torch.clamp(max_norm / (squares.sqrt() + 1e-6), max=1.0)
    for group_grads in _by_dtype([p.grad for p in params if p.grad is not None]):
        torch._foreach_mul_(group_grads, coefficient.to(group_grads[0].dtype))


def _by_dtype(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return list(groups.values())


@torch.no_grad()
def broadcast_flat(tensors: Sequence[torch.Tensor], src: int, group: Any) -> None:
    """Broadcast ``tensors`` (any dtypes) from global rank ``src`` as one message of their bytes."""
    if not tensors:
        return
    flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])
    dist.broadcast(flat, src=src, group=group)
    offset = 0
    for t in tensors:
        size = t.numel() * t.element_size()
        t.copy_(flat[offset : offset + size].view(t.dtype).view(t.shape))
        offset += size
