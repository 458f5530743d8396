"""Gradient collectives of one pipeline update: replica averaging, shared-parameter sums, clipping.

Plain torch.distributed (no Lightning). Run at a STEP action, in the same order on every stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def average_over_replicas(params: Sequence[nn.Parameter], group: Any, size: int) -> None:
    """Average gradients over the data-parallel replicas of this stage (async all-reduces, then divide)."""
    if size <= 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    works = [dist.all_reduce(g, group=group, async_op=True) for g in grads]
    for work, grad in zip(works, grads):
        work.wait()
        grad.div_(size)


def sum_shared(shared: Sequence[tuple[nn.Parameter, Any]]) -> None:
    """A parameter held by several stages (a tied embedding) gets the sum of their gradients on each."""
    for param, group in shared:
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad, group=group)


def clip_by_norm(
    params: Sequence[nn.Parameter],
    max_norm: float,
    not_counted: set[int],
    group: Any | None,
    device: torch.device,
) -> None:
    """Clip by the global L2 norm: this stage's squares (shared parameters counted on one stage only,
    ``not_counted`` holds the others' ids) summed over ``group`` (None: this stage's norm alone)."""
    squares = torch.zeros((), device=device, dtype=torch.float32)
    for param in params:
        if param.grad is not None and id(param) not in not_counted:
            squares += param.grad.float().pow(2).sum()
    if group is not None:
        dist.all_reduce(squares, group=group)
    coefficient = torch.clamp(max_norm / (squares.sqrt() + 1e-6), max=1.0)
    for param in params:
        if param.grad is not None:
            param.grad.mul_(coefficient.to(param.grad.dtype))
