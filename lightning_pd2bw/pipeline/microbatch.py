"""Split a batch (tensors, or dicts/lists/tuples of them) into equal microbatches along dimension 0."""

from __future__ import annotations

from typing import Any

import torch


def _sizes(batch: Any) -> set[int]:
    if isinstance(batch, torch.Tensor):
        return {batch.shape[0]}
    if isinstance(batch, dict):
        return set().union(*map(_sizes, batch.values())) if batch else set()
    if isinstance(batch, (list, tuple)):
        return set().union(*map(_sizes, batch)) if batch else set()
    return set()


def _take(batch: Any, index: int, count: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.chunk(count)[index]
    if isinstance(batch, dict):
        return {k: _take(v, index, count) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_take(v, index, count) for v in batch)
    return batch


def batch_size_of(batch: Any) -> int:
    sizes = _sizes(batch)
    if len(sizes) != 1:
        raise ValueError(f"a batch's tensors must share their first dimension; found sizes {sorted(sizes)}")
    return sizes.pop()


def split_microbatches(batch: Any, num_microbatches: int) -> list[Any]:
    size = batch_size_of(batch)
    if size % num_microbatches:
        raise ValueError(
            f"batch size {size} is not divisible into num_microbatches={num_microbatches}: the per-replica batch "
            f"must be micro_batch_size x num_microbatches; use a batch size that is a multiple of {num_microbatches}"
        )
    return [_take(batch, j, num_microbatches) for j in range(num_microbatches)]


def resize_batch(batch: Any, size: int) -> Any:
    """``size`` samples from ``batch``: its first ones, or it repeated (a sample batch for profiling)."""
    if not isinstance(batch, (torch.Tensor, dict, list, tuple)):
        return batch  # a non-tensor field travels unchanged
    if isinstance(batch, torch.Tensor):
        have = batch.shape[0]
        repeats = -(-size // have)
        return batch.repeat(repeats, *[1] * (batch.dim() - 1))[:size] if repeats > 1 else batch[:size]
    if isinstance(batch, dict):
        return {k: resize_batch(v, size) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(resize_batch(v, size) for v in batch)
    return batch


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor (in dicts, lists, tuples) moved to ``device``; other values unchanged."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch
