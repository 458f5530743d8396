"""Issue 98, item 3: the training data checked whole before launch, and its identity recorded in the checkpoint so
that a resume on other data is refused by name (or, with ``data.allow_changed``, restarts the data position)."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from lightning_pd2bw.cli.checks import ConfigError, check_text_files
from lightning_pd2bw.data import TextDataModule
from lightning_pd2bw.data.datamodule import DataChanged
from lightning_pd2bw.lightning.data_position import make_resumable, resume_at

TEXT = ("The quick brown fox jumps over the lazy dog. " * 40 + "\n").encode()


def text_file(path, size: int):
    path.write_bytes((TEXT * (size // len(TEXT) + 1))[:size])
    return path


def test_a_corpus_binary_past_its_first_64_kib_is_refused(tmp_path):
    """96 KiB of text, then 75% random bytes: the old check read the first 64 KiB and let it train to ln 256."""
    corpus = text_file(tmp_path / "corpus.txt", 96 << 10)
    with open(corpus, "ab") as handle:
        handle.write(random.Random(0).randbytes(288 << 10))
    with pytest.raises(ConfigError, match=r"corpus.txt' is not UTF-8 text \(.* at byte 98,") as error:
        check_text_files([str(corpus)])
    assert "pd2bw-prepare-data" in str(error.value)


def test_a_nul_byte_anywhere_is_refused_with_its_offset(tmp_path):
    corpus = text_file(tmp_path / "corpus.txt", 9 << 20)  # over two of the check's chunks
    data = bytearray(corpus.read_bytes())
    data[(9 << 20) - 10] = 0
    corpus.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=f"a NUL byte at byte {(9 << 20) - 10:,}"):
        check_text_files([str(corpus)])
    text_file(corpus, 9 << 20)
    check_text_files([str(corpus)])  # whole text passes


def module(path, **kwargs) -> TextDataModule:
    data = TextDataModule(seq_len=16, batch_size=4, paths=[str(path)], **kwargs)
    data.setup("fit")
    return data


def test_the_checkpoint_records_each_files_size_and_checksum(tmp_path):
    corpus = text_file(tmp_path / "corpus.txt", 50_000)
    recorded = module(corpus).state_dict()["files"]
    assert list(recorded) == [str(corpus)]
    assert recorded[str(corpus)]["bytes"] == 50_000 and recorded[str(corpus)]["used"] == 50_000
    module(corpus).load_state_dict({"files": recorded})  # the same data: resumes


@pytest.mark.parametrize(
    "change,message",
    [
        ("truncate", r"has 16,666 bytes, the checkpoint's run read 50,000"),
        ("replace", r"has the same size but other bytes"),
    ],
)
def test_a_resume_on_changed_data_is_refused_naming_the_file(tmp_path, change, message):
    corpus = text_file(tmp_path / "corpus.txt", 50_000)
    recorded = module(corpus).state_dict()
    if change == "truncate":  # to a third: the old position would have been applied to a third of the windows
        text_file(corpus, 16_666)
    else:
        data = bytearray(corpus.read_bytes())
        data[1000:1003] = b"XYZ"
        corpus.write_bytes(bytes(data))
    with pytest.raises(DataChanged, match=message) as error:
        module(corpus).load_state_dict(recorded)
    assert "corpus.txt" in str(error.value) and "data.allow_changed=true" in str(error.value)
    allowed = module(corpus, allow_changed=True)
    with pytest.warns(UserWarning, match="the data position restarts"):
        allowed.load_state_dict(recorded)
    assert allowed.data_changed


def test_a_data_position_is_never_applied_to_a_dataset_of_another_size():
    """Any data module: the position records the training set's size; a resume on one of another size is refused."""
    dataset = torch.arange(40).view(20, 2)
    loader = make_resumable(DataLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, 1, 0)))
    position = {"epoch": 0, "samples_in_epoch": 4, "dataset_samples": 60}
    with pytest.raises(DataChanged, match="the training set has 20 samples; the checkpoint's run had 60"):
        resume_at(loader, position)
    resume_at(loader, {**position, "dataset_samples": 20})  # the same size: placed
