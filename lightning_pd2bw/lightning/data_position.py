"""Restore the training data position exactly: a resumed epoch starts where the checkpoint left it.

Lightning gives each replica a ``DistributedSampler``: the epoch's permutation (seeded by ``seed +
epoch``), dealt round-robin, so after ``k`` batches of ``b`` samples on ``w`` replicas exactly the
first ``k * b * w`` positions of the permutation are consumed, whatever the replica. The checkpoint
records that count; ``ResumableDistributedSampler`` skips it and deals the rest to the replicas of
the resumed run, which may be fewer or more (resharding) — no sample is repeated or skipped.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset


class ResumableDistributedSampler(DistributedSampler):
    """``DistributedSampler`` whose next epoch can start after ``start`` samples of its global order."""

    def __init__(self, base: DistributedSampler) -> None:
        super().__init__(
            base.dataset,
            num_replicas=base.num_replicas,
            rank=base.rank,
            shuffle=base.shuffle,
            seed=base.seed,
            drop_last=base.drop_last,
        )
        self.epoch = base.epoch
        self._resume: tuple[int, int] | None = None

    def resume(self, epoch: int, start: int) -> None:
        """The next iteration over epoch ``epoch`` begins at global position ``start``."""
        self._resume = (epoch, start)

    def global_order(self) -> torch.Tensor:
        """The epoch's order over all replicas, padded or cut as ``DistributedSampler`` does: the same permutation
        (``torch.randperm`` seeded by ``seed + epoch``), held as a tensor of 4-byte indices, never a Python list
        (at the gpt13b recipe's 146M windows a list was about 5 GB per rank; the tensor is 0.6 GB while the epoch
        starts, and each rank then keeps its own share)."""
        n = len(self.dataset)
        dtype = torch.int32 if n < 2**31 else torch.int64
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            indices = torch.randperm(n, generator=generator, dtype=dtype)
        else:
            indices = torch.arange(n, dtype=dtype)
        if self.drop_last:
            return indices[: self.total_size]
        padding = self.total_size - n
        if padding > 0:
            indices = torch.cat([indices, indices.repeat(math.ceil(padding / max(n, 1)))[:padding]])
        return indices

    def __iter__(self) -> Iterator[int]:
        order = self.global_order()
        if self._resume is not None:
            epoch, start = self._resume
            self._resume = None
            if epoch == self.epoch:
                order = order[start:]
        share = order[self.rank :: self.num_replicas].clone()  # this replica's positions; the rest is freed
        del order
        return _ints(share)


def _ints(indices: torch.Tensor, block: int = 1 << 16) -> Iterator[int]:
    """The indices as Python ints, a block at a time."""
    for part in indices.split(block):
        yield from part.tolist()


def uses_batch_sampler(loader: DataLoader) -> bool:
    """Whether ``loader`` batches with its own ``batch_sampler`` (not ``batch_size``)."""
    return loader.batch_size is None and loader.batch_sampler is not None


def samplers_of(loader: DataLoader) -> list[Any]:
    """The loader's sampler and, with a custom batch sampler, the sampler inside it."""
    inner = getattr(loader.batch_sampler, "sampler", None)
    return [loader.sampler] + ([inner] if inner is not None and inner is not loader.sampler else [])


def distributed_sampler_of(loader: DataLoader) -> DistributedSampler | None:
    """The ``DistributedSampler`` Lightning put in ``loader`` (or in its custom batch sampler), if any."""
    return next((s for s in samplers_of(loader) if type(s) is DistributedSampler), None)


def rebuild(loader: DataLoader, sampler: Any = None, **changes: Any) -> DataLoader:
    """The same loader (class, dataset, workers, collate, pinning, ...) with ``sampler`` (default: its own) and
    init arguments in ``changes`` (e.g. ``batch_size``) replaced: Lightning's own re-creation (``compat``)."""
    from .compat import reinstantiate_dataloader

    if "batch_size" in changes and uses_batch_sampler(loader):
        raise ValueError(
            f"this DataLoader batches with its own batch_sampler ({type(loader.batch_sampler).__name__}); pd2bw "
            f"cannot re-batch it to batch_size={changes['batch_size']}: build it with batch_size=... instead"
        )
    if sampler is None:
        sampler = None if isinstance(loader.dataset, IterableDataset) else distributed_sampler_of(loader)
        sampler = sampler if sampler is not None else loader.sampler
    return reinstantiate_dataloader(loader, sampler, **changes)


def make_resumable(loader: DataLoader) -> DataLoader:
    """The same loader with a ``ResumableDistributedSampler`` (also inside a custom batch sampler); loaders
    without Lightning's ``DistributedSampler`` are returned unchanged."""
    sampler = distributed_sampler_of(loader)
    if sampler is None:
        return loader
    return rebuild(loader, sampler=ResumableDistributedSampler(sampler))


def resume_at(loader: DataLoader, position: dict[str, Any]) -> None:
    """Continue ``loader`` (made resumable) at a checkpoint's data position: its epoch and the samples of that
    epoch's global order every replica consumed. A sampler that is not resumable restarts its epoch (a warning)."""
    import warnings

    if not position["samples_in_epoch"]:
        return
    recorded, now = position.get("dataset_samples"), dataset_length(loader.dataset)
    if recorded is not None and now is not None and recorded != now:
        from ..data.datamodule import DataChanged

        raise DataChanged(
            f"the training set has {now:,} samples; the checkpoint's run had {recorded:,}: the data changed, and its "
            f"position ({position['samples_in_epoch']:,} samples into epoch {position['epoch']}) would be applied "
            "to other data. Resume with the same data, or (TextDataModule) set data.allow_changed=true to restart "
            "the data position at the start of the resumed epoch"
        )
    found = [s for s in samplers_of(loader) if isinstance(s, ResumableDistributedSampler)]
    sampler = found[0] if found else loader.sampler
    if not isinstance(sampler, ResumableDistributedSampler):
        warnings.warn(
            f"pd2bw: the training sampler is a {type(sampler).__name__}, not Lightning's DistributedSampler: "
            "the resumed epoch restarts from its first batch (batches may repeat). Let Lightning inject "
            "the sampler (use_distributed_sampler=True) for an exact data position",
            stacklevel=3,
        )
        return
    sampler.resume(position["epoch"], position["samples_in_epoch"])
    # Lightning warns that a plain DataLoader is not resumable; this one's position is restored above
    warnings.filterwarnings("ignore", message=r"You're resuming from a checkpoint that ended before")


def dataset_length(dataset: Any) -> int | None:
    """``len(dataset)``, or None for one without a length (an iterable dataset)."""
    try:
        return len(dataset)
    except TypeError:
        return None


def prepare_train_loader(
    loader: DataLoader,
    trainer: Any,
    num_microbatches: int,
    per_replica_batch: int | None = None,
    position: dict[str, Any] | None = None,
) -> DataLoader:
    """The strategy's training loader: re-batched to ``per_replica_batch`` (``plan="auto"``), with a resumable
    sampler placed at ``position`` (a resumed checkpoint's), and its last batch checked against the microbatches
    when the run reaches it."""
    from ..engine.comm.microbatch import check_last_batch

    if per_replica_batch is not None and loader.batch_size != per_replica_batch:
        if loader.batch_size is None:
            raise ValueError("plan='auto' re-batches the dataloader and needs a DataLoader built with batch_size=...")
        loader = rebuild(loader, batch_size=per_replica_batch)
    loader = make_resumable(loader)
    try:
        samples = len(loader.sampler)
    except TypeError:  # an iterable dataset: no length
        samples = None
    size = loader.batch_size
    if samples is not None:
        full = samples // size if size else 0
        reaches_last = (trainer.max_steps == -1 or trainer.max_steps > full) and trainer.limit_train_batches in (
            None,
            1.0,
        )
        if reaches_last or (size and size % num_microbatches):
            check_last_batch(samples, size, loader.drop_last, num_microbatches)
    if position is not None and not getattr(trainer.datamodule, "data_changed", False):  # allow_changed: restart
        resume_at(loader, position)
    return loader
