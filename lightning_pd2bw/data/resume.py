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

    def global_order(self) -> list[int]:
        """The epoch's order over all replicas, padded or cut as ``DistributedSampler`` does."""
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            indices = torch.randperm(len(self.dataset), generator=generator).tolist()
        else:
            indices = list(range(len(self.dataset)))
        if self.drop_last:
            return indices[: self.total_size]
        padding = self.total_size - len(indices)
        return indices + (indices * math.ceil(padding / max(len(indices), 1)))[:padding]

    def __iter__(self) -> Iterator[int]:
        order = self.global_order()
        if self._resume is not None:
            epoch, start = self._resume
            self._resume = None
            if epoch == self.epoch:
                order = order[start:]
        return iter(order[self.rank :: self.num_replicas])


def rebuild(loader: DataLoader, **changes: Any) -> DataLoader:
    """The same loader (dataset, workers, collate, ...) with ``batch_size`` and/or ``sampler`` replaced."""
    iterable = isinstance(loader.dataset, IterableDataset)
    args = dict(
        batch_size=loader.batch_size,
        sampler=None if iterable else loader.sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor,
        persistent_workers=loader.persistent_workers,
    )
    return DataLoader(loader.dataset, **(args | changes))


def make_resumable(loader: DataLoader) -> DataLoader:
    """The same loader with a ``ResumableDistributedSampler`` (other samplers are returned unchanged)."""
    sampler = loader.sampler
    if type(sampler) is not DistributedSampler:
        return loader
    return rebuild(loader, sampler=ResumableDistributedSampler(sampler))
