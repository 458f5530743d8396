from __future__ import annotations

import pytest
import torch

from lightning_pd2bw.data import LMDataset, MLMDataset, read_corpus, split
from lightning_pd2bw.engine.comm.microbatch import split_microbatches
from lightning_pd2bw.models.core import MASK_TOKEN


def test_embedded_corpus_is_deterministic_python_source():
    a, b = read_corpus(max_bytes=10_000), read_corpus(max_bytes=10_000)
    assert torch.equal(a, b) and len(a) == 10_000
    assert b"import" in bytes(read_corpus(max_bytes=200_000).tolist())


def test_split_and_lm_windows():
    train, val = split(read_corpus(max_bytes=10_000), 0.1)
    assert len(train) == 9_000 and len(val) == 1_000
    item = LMDataset(train, 16)[3]
    assert torch.equal(item["input_ids"][1:], item["labels"][:-1])


def test_mlm_masks_are_seeded_and_targets_only_masked():
    data = read_corpus(max_bytes=10_000)
    a, b = MLMDataset(data, 32, seed=1)[5], MLMDataset(data, 32, seed=1)[5]
    assert torch.equal(a["input_ids"], b["input_ids"])
    targets = a["labels"] != -100
    assert targets.any() and (a["input_ids"][~targets] == data[160:192].long()[~targets]).all()
    assert (a["input_ids"] == MASK_TOKEN).any() or targets.sum() < 3


def test_empty_and_missing_inputs_name_the_fix(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="is empty; give data.paths files that contain text"):
        read_corpus([empty])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_corpus([tmp_path / "missing.txt"])
    with pytest.raises(ValueError, match="fewer than one sequence of data.seq_len=64"):
        LMDataset(torch.zeros(10, dtype=torch.uint8), 64)


def test_microbatch_split():
    batch = {"input_ids": torch.arange(12).view(6, 2), "labels": torch.arange(6)}
    parts = split_microbatches(batch, 3)
    assert [p["labels"].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="batch size 6 is not divisible into num_microbatches=4"):
        split_microbatches(batch, 4)
