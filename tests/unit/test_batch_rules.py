"""Boundary and batch rules are checked at the first batch (or before the epoch), naming the layer and the fix."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from lightning_pd2bw.engine.comm.microbatch import batch_device, check_last_batch, split_microbatches
from lightning_pd2bw.engine.executor import StageExecutor


def test_per_sample_fields_are_split_and_others_travel_whole():
    batch = {"input_ids": torch.arange(8).view(4, 2), "text": ["a", "b", "c", "d"], "meta": {"lang": "en"}}
    first, second = split_microbatches(batch, 2)
    assert first["text"] == ["a", "b"] and second["text"] == ["c", "d"]
    assert torch.equal(second["input_ids"], torch.tensor([[4, 5], [6, 7]]))
    assert first["meta"] == {"lang": "en"}
    plain = split_microbatches(torch.zeros(4, 128), 2)  # a plain tensor batch: sized by its rows, not its length
    assert [p.shape for p in plain] == [torch.Size([2, 128])] * 2


def test_uneven_last_batch_is_refused_before_the_epoch():
    with pytest.raises(ValueError, match=r"last batch of each epoch holds 3 samples .*pass drop_last=True"):
        check_last_batch(samples_per_replica=19, batch_size=8, drop_last=False, m=2)
    check_last_batch(samples_per_replica=19, batch_size=8, drop_last=True, m=2)
    check_last_batch(samples_per_replica=20, batch_size=8, drop_last=False, m=2)  # last batch of 4 splits in 2
    with pytest.raises(ValueError, match=r"batch_size=6 is not divisible into num_microbatches=4"):
        check_last_batch(samples_per_replica=24, batch_size=6, drop_last=True, m=4)


class ReturnsDict(nn.Module):
    def forward(self, x):
        return {"hidden": x}


@pytest.mark.parametrize(
    "outputs, shown",
    [({"hidden": torch.ones(1)}, "returned dict"), ((torch.ones(1), None), r"returned \(Tensor, NoneType\)")],
)
def test_boundary_output_that_cannot_cross_is_named(outputs, shown):
    stage = SimpleNamespace(stage=0, layers=[nn.Linear(1, 1), ReturnsDict()])
    with pytest.raises(TypeError, match=rf"last layer of stage 0 \(ReturnsDict\) {shown}.*tuple of tensors"):
        StageExecutor._boundary(stage, outputs)
    assert StageExecutor._boundary(stage, (torch.ones(1), torch.ones(1, dtype=torch.long)))[1].dtype == torch.long


def test_predictions_join_in_order():
    from lightning_pd2bw.engine.comm.microbatch import join_microbatches

    batch = {"logits": torch.arange(12.0).view(6, 2), "text": ["a", "b", "c", "d", "e", "f"]}
    parts = split_microbatches(batch, 3)
    joined = join_microbatches(parts)
    assert torch.equal(joined["logits"], batch["logits"]) and joined["text"] == batch["text"]
    assert torch.equal(join_microbatches([torch.tensor(1.0), torch.tensor(2.0)]), torch.tensor([1.0, 2.0]))


def test_only_the_end_stages_take_the_batch_to_the_device():
    gpu = torch.device("cuda", 3)
    assert [batch_device(s, 4, gpu) for s in range(4)] == [gpu, torch.device("cpu"), torch.device("cpu"), gpu]
    assert batch_device(0, 1, gpu) == gpu
    assert [batch_device(s, 2, gpu) for s in range(2)] == [gpu, gpu]
