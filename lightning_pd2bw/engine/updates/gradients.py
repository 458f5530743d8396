"""Gradient collectives of one pipeline update: replica averaging, shared-parameter sums, clipping (and the
broadcast that starts every replica of a stage from the same weights).

Plain torch.distributed (no Lightning). Run by the update's actions (REDUCE, CHECK, CLIP), in the same order on
every stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from .collectives import Collective

BUCKET_BYTES = 25 * 1024**2  # as DDP: few large messages instead of one per tensor


def replica_bucket_bytes(width: int, itemsize: int = 4) -> int:
    """Bytes per bucket of a stage's replicated gradients (``grad_buckets.py``; the planner counts the same):
    Megatron-LM's rule, ``max(40M, 1M x width)`` gradients a bucket, not DDP's 25 MiB. A pipeline stage reduces its
    buckets inside one microbatch's backward (Flush) or beside the next batch (2BW), not across a whole backward as
    DDP does, so per-collective latency (each bucket's ring of 2 (w - 1) steps, or w reduces to owners) weighs more
    than the last bucket's tail: at 13B on 8 x 8 H100, 25 MiB buckets are 482 a stage, 160 MB ones 85."""
    return max(40_000_000, 1_000_000 * width) * itemsize


def buckets(
    tensors: Sequence[torch.Tensor], limit: int = BUCKET_BYTES, dtype: torch.dtype | None = None
) -> list[list[torch.Tensor]]:
    """Consecutive tensors grouped by dtype and device into buckets of at most ``limit`` bytes (or one tensor);
    ``dtype``: the one dtype the buckets hold, whatever the tensors' (their float32 main gradients)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * (dtype or tensor.dtype).itemsize
        last = out[-1] if out else None
        same = dtype is not None or (last and last[0].dtype == tensor.dtype)
        if last and same and last[0].device == tensor.device and size + nbytes <= limit:
            last.append(tensor)
            size += nbytes
        else:
            out.append([tensor])
            size = nbytes
    return out


def average_over_replicas(grads: Sequence[torch.Tensor], group: Any, size: int, declared: Collective) -> None:
    """Average ``grads`` in place over the data-parallel replicas of this stage: flattened buckets, all-reduced
    asynchronously (``declared``: the caller's all-reduce), then divided and copied back (element-wise the same sums
    as one call per tensor).

    At most two buckets are flattened at a time (the next one's all-reduce runs while the previous is
    copied back), so the extra memory is two buckets, not a second copy of every gradient."""
    if size <= 1 or not grads:
        return
    in_flight: list[tuple[list[torch.Tensor], torch.Tensor, Any]] = []

    def finish(bucket: list[torch.Tensor], buffer: torch.Tensor, work: Any) -> None:
        work.wait()
        buffer.div_(size)
        torch._foreach_copy_(bucket, torch._utils._unflatten_dense_tensors(buffer, bucket))

    for bucket in buckets(grads):
        buffer = torch._utils._flatten_dense_tensors(bucket)
        in_flight.append((bucket, buffer, declared.issue(buffer, group)))
        if len(in_flight) > 1:
            finish(*in_flight.pop(0))
    for entry in in_flight:
        finish(*entry)


def nonfinite_flag(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """A one-element float tensor on ``device``: 1.0 if any entry of ``grads`` is non-finite, else 0.0 (no sync)."""
    if not grads:
        return torch.zeros(1, device=device)
    return finite_flags(grads).all().logical_not().float().reshape(1)


def finite_flags(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """One bool per gradient, on its device (no sync): True where every entry is finite.

    Exact and one read of each gradient: a tensor's min and max are both finite if and only if every entry is
    (``aminmax`` propagates NaN; +inf shows in the max, -inf in the min). ``isfinite(g).all()`` first writes a
    mask of the gradient's size and reads it again: ~10x slower on a CPU core (7M entries: 2.5 vs 25 ms). Sparse
    gradients are checked on their coalesced values, complex ones on their real and imaginary parts, empty ones are
    finite."""
    extremes: list[torch.Tensor] = []
    for grad in grads:
        values = grad.coalesce().values() if grad.is_sparse else grad
        values = torch.view_as_real(values) if values.is_complex() else values
        if values.numel() == 0:
            extremes += [torch.zeros((), dtype=values.dtype, device=values.device)] * 2
        else:
            extremes += torch.aminmax(values)
    return torch.isfinite(torch.stack(extremes).view(-1, 2)).all(dim=1)


class FiniteWatch:
    """The ``stop`` policy's check without a host sync per update.

    ``push`` computes one flag per gradient on the device and starts copying them to the host (pinned memory,
    non-blocking, a CUDA event behind the copy); ``poll`` reads the flags of every update whose copy has
    landed (all of them with ``wait=True``, e.g. at a drain) and returns the first update with a non-finite
    gradient. On the CPU the flags are read at once, so the run stops at the update that saw them; on a GPU
    at the first update after the copy landed (typically the next one), before the weights are saved."""

    def __init__(self) -> None:
        self.pending: list[tuple[int, list[nn.Parameter], torch.Tensor, Any]] = []

    def push(self, step: int, params: Sequence[nn.Parameter]) -> None:
        with_grad = [p for p in params if p.grad is not None]
        if not with_grad:
            return
        flags = finite_flags([p.grad for p in with_grad])
        event = None
        if flags.device.type == "cuda":
            host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            flags = host
        self.pending.append((step, with_grad, flags, event))

    def poll(self, wait: bool = False) -> tuple[int, list[nn.Parameter]] | None:
        """(update, its parameters with non-finite gradients) of the first such update read, else None."""
        while self.pending:
            step, params, flags, event = self.pending[0]
            if event is not None and not event.query():
                if not wait:
                    return None
                event.synchronize()
            self.pending.pop(0)
            if not bool(flags.all()):  # host memory: no device sync
                return step, [p for p, finite in zip(params, flags.tolist()) if not finite]
        return None


def squared_norm(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of the squares of ``grads``' entries, in float32 on ``device`` (one fused norm kernel per dtype, no
    loop over tensors): this stage's part of the clip norm, summed over the pipeline by the caller (global mode)."""
    squares = torch.zeros((), device=device, dtype=torch.float32)
    for group_grads in _by_dtype(grads):
        squares += torch.stack(torch._foreach_norm(group_grads)).float().pow(2).sum()
    return squares


def scale_to_norm(grads: Sequence[torch.Tensor], squares: torch.Tensor, max_norm: float) -> None:
    """Clip ``grads`` in place to ``max_norm``, their total norm being ``sqrt(squares)`` (as
    ``torch.nn.utils.clip_grad_norm_``: coefficient ``max_norm / (norm + 1e-6)``, at most 1)."""
    coefficient = torch.clamp(max_norm / (squares.sqrt() + 1e-6), max=1.0)
    for group_grads in _by_dtype(grads):
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
