"""Split a batch (tensors, or dicts/lists/tuples of them) into equal microbatches along dimension 0.

A list or tuple of plain values (strings, numbers: what ``default_collate`` leaves of a text field) is a
per-sample field and is split like a tensor; any other non-tensor value travels whole to every microbatch.
"""

from __future__ import annotations

from typing import Any

import torch


def _per_sample(batch: Any) -> bool:
    """A list/tuple of plain values (no tensors or containers): one value per sample."""
    return (
        isinstance(batch, (list, tuple))
        and len(batch) > 0
        and not any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in batch)
    )


def _sizes(batch: Any) -> set[int]:
    if isinstance(batch, torch.Tensor):
        return {batch.shape[0]} if batch.dim() else set()
    if _per_sample(batch):
        return {len(batch)}
    if isinstance(batch, dict):
        return set().union(*map(_sizes, batch.values())) if batch else set()
    if isinstance(batch, (list, tuple)):
        return set().union(*map(_sizes, batch)) if batch else set()
    return set()


def _take(batch: Any, index: int, count: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.chunk(count)[index] if batch.dim() else batch
    if _per_sample(batch):
        size = len(batch) // count
        return type(batch)(batch[index * size : (index + 1) * size])
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
            f"must be micro_batch_size x num_microbatches; use a batch size that is a multiple of {num_microbatches}, "
            "and DataLoader(drop_last=True) if the last batch of an epoch is smaller"
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


def batch_device(stage: int, num_stages: int, device: torch.device) -> torch.device:
    """Where a stage needs its batch: only the first stage (inputs) and the last (targets) read its values; a
    middle stage keys its link by the batch's shapes alone, so its copy stays on the host (no transfer)."""
    return device if stage in (0, num_stages - 1) else torch.device("cpu")


def check_last_batch(samples_per_replica: int | None, batch_size: int | None, drop_last: bool, m: int) -> None:
    """Before an epoch runs: refuse a loader whose last batch cannot be cut into ``m`` equal microbatches."""
    if batch_size and batch_size % m:
        raise ValueError(
            f"the DataLoader's batch_size={batch_size} is not divisible into num_microbatches={m}: use a multiple of {m}"
        )
    if not samples_per_replica or not batch_size or drop_last:
        return
    last = samples_per_replica % batch_size
    if last and last % m:
        raise ValueError(
            f"the last batch of each epoch holds {last} samples per replica ({samples_per_replica} samples, "
            f"batch_size={batch_size}), which do not split into num_microbatches={m}: pass drop_last=True to the "
            "DataLoader (or trainer.limit_train_batches to stop before it)"
        )


def join_microbatches(parts: list[Any]) -> Any:
    """The inverse of ``split_microbatches`` for results: tensors concatenated along dimension 0, dicts, lists
    and tuples joined field by field (a list of per-sample values concatenated); anything else as a list."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts) if first.dim() else torch.stack(parts)
    if isinstance(first, dict):
        return {k: join_microbatches([p[k] for p in parts]) for k in first}
    if _per_sample(first):
        return type(first)(v for p in parts for v in p)
    if isinstance(first, (list, tuple)):
        return type(first)(join_microbatches(list(f)) for f in zip(*parts))
    return parts
