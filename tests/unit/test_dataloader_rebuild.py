"""Re-created training loaders keep everything the user built them with (Lightning's own re-creation)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

from lightning_pd2bw.lightning.data_position import ResumableDistributedSampler, make_resumable, rebuild


class EveryOtherBatch(BatchSampler):
    """A user's batch sampler: keeps every other batch of its sampler."""

    def __iter__(self):
        for i, batch in enumerate(super().__iter__()):
            if i % 2 == 0:
                yield batch

    def __len__(self) -> int:
        return (super().__len__() + 1) // 2


def collate(items):
    return torch.stack([x for (x,) in items]) * 10


DATA = TensorDataset(torch.arange(32.0))


def test_custom_batch_sampler_and_pinning_survive_make_resumable():
    sampler = DistributedSampler(DATA, num_replicas=2, rank=1, shuffle=True, seed=3)
    loader = DataLoader(
        DATA,
        batch_sampler=EveryOtherBatch(sampler, batch_size=4, drop_last=True),
        pin_memory=True,
        pin_memory_device="cpu",
        collate_fn=collate,
        num_workers=1,
        multiprocessing_context="fork",
        timeout=7,
    )
    resumable = make_resumable(loader)
    assert type(resumable.batch_sampler) is EveryOtherBatch and resumable.batch_sampler.batch_size == 4
    inner = resumable.batch_sampler.sampler
    assert isinstance(inner, ResumableDistributedSampler) and (inner.rank, inner.num_replicas, inner.seed) == (1, 2, 3)
    assert resumable.pin_memory and resumable.pin_memory_device == "cpu" and resumable.timeout == 7
    assert resumable.num_workers == 1 and resumable.multiprocessing_context is loader.multiprocessing_context
    assert resumable.collate_fn is collate
    assert [b.tolist() for b in resumable] == [b.tolist() for b in loader], "the same batches in the same order"
    inner.resume(0, 8)  # two batches of 4 over two replicas were consumed: this rank's next samples follow
    order = inner.global_order()[8:][1::2].tolist()
    first = next(iter(resumable))
    assert first.tolist() == [10 * i for i in order[:4]]


def test_rebatch_keeps_the_loader_arguments():
    sampler = DistributedSampler(DATA, num_replicas=2, rank=0, shuffle=False)
    generator = torch.Generator().manual_seed(5)
    loader = DataLoader(
        DATA, batch_size=8, sampler=sampler, pin_memory=True, pin_memory_device="cpu", collate_fn=collate,
        generator=generator,
    )  # fmt: skip
    smaller = rebuild(loader, batch_size=2)
    assert smaller.batch_size == 2 and smaller.sampler is sampler
    assert smaller.pin_memory and smaller.pin_memory_device == "cpu" and smaller.generator is generator
    assert smaller.collate_fn is collate
    assert next(iter(smaller)).tolist() == [0.0, 20.0]


def test_rebatching_a_custom_batch_sampler_is_refused_with_the_fix():
    loader = DataLoader(DATA, batch_sampler=EveryOtherBatch(DistributedSampler(DATA, 2, 0), 4, True))
    with pytest.raises(ValueError, match="own batch_sampler \\(EveryOtherBatch\\).*batch_size=..."):
        rebuild(loader, batch_size=2)
