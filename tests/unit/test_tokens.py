"""``pd2bw-prepare-data`` and ``data=tokens``: local texts to memory-mapped token shards, windows read back."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_pd2bw.data.hf import load_tokenizer
from lightning_pd2bw.data.tokens import EOT, TokenDataset, main, prepare, read_index

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    root = tmp_path_factory.mktemp("texts")
    (root / "sub").mkdir()
    words = "pipeline stage weight version microbatch gradient update flush double buffer".split()
    rng = np.random.default_rng(0)
    for i in range(6):
        body = " ".join(rng.choice(words, size=400))
        (root / ("sub" if i % 2 else ".") / f"doc{i}.txt").write_text(f"Document {i}. {body}\n")
    return root


def stream(texts_dir, tokenizer) -> list[int]:
    ids = []
    for file in sorted(p for p in texts_dir.rglob("*") if p.is_file()):
        ids += tokenizer.encode(file.read_text()).ids + [tokenizer.token_to_id(EOT)]
    return ids


def test_prepare_trains_a_tokenizer_and_windows_read_back_the_stream(texts, tmp_path, capsys):
    out = tmp_path / "tokens"
    main([str(out), str(texts), "--vocab-size", "300", "--val-fraction", "0.1", "--shard-tokens", "1000"])
    assert "pd2bw-train data=tokens data.path=" in capsys.readouterr().out
    index = read_index(out)
    assert index["dtype"] == "uint16" and index["vocab_size"] <= 300 and index["documents"] == 6
    assert len(index["splits"]["train"]) > 1, "several shards"
    ids = stream(texts, load_tokenizer(str(out)))
    assert index["tokens"] == len(ids)
    on_disk = np.concatenate([np.fromfile(out / name, dtype=np.uint16) for name, _ in index["splits"]["train"]])
    assert on_disk.tolist() == ids[: len(on_disk)]
    seq = 31
    data = TokenDataset(out, seq, "train")
    expected = []
    offset = 0
    for _, count in index["splits"]["train"]:  # windows never cross a shard
        shard = ids[offset : offset + count]
        expected += [shard[i * (seq + 1) : (i + 1) * (seq + 1)] for i in range(count // (seq + 1))]
        offset += count
    assert len(data) == len(expected)
    for i in (0, 1, len(data) // 2, len(data) - 1):
        item = data[i]
        assert item["input_ids"].tolist() == expected[i][:-1] and item["labels"].tolist() == expected[i][1:]
        assert item["input_ids"].dtype == torch.int64
    assert len(TokenDataset(out, seq, "val")) > 0


def test_a_given_tokenizer_gives_the_same_shards(texts, tmp_path):
    first = prepare(tmp_path / "a", [texts], vocab_size=300)
    second = prepare(tmp_path / "b", [texts], tokenizer=str(tmp_path / "a" / "tokenizer.json"))
    assert first["splits"] == second["splits"]
    for name, _ in first["splits"]["train"]:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_workers_open_their_own_maps(texts, tmp_path):
    prepare(tmp_path / "t", [texts], vocab_size=300)
    data = TokenDataset(tmp_path / "t", 15)
    data[0]  # opens a map in this process
    assert pickle.loads(pickle.dumps(data))._maps == {}
    loader = DataLoader(data, batch_size=4, num_workers=1, multiprocessing_context="fork")
    plain = DataLoader(data, batch_size=4)
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(loader, plain))


def test_missing_corpus_names_the_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="Prepare one with: pd2bw-prepare-data .*nothing"):
        TokenDataset(tmp_path / "nothing", 8)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        prepare(tmp_path / "out", [tmp_path / "absent.txt"])


def test_resume_at_another_width_reads_each_window_once(texts, tmp_path):
    """Two replicas read 3 batches each, the run is resumed on one replica: together they read every window of the
    epoch once, in the epoch's order (the resumable sampler over the map-style token windows)."""
    from torch.utils.data import DistributedSampler

    from lightning_pd2bw.lightning.data_position import make_resumable

    prepare(tmp_path / "t", [texts], vocab_size=300)
    data = TokenDataset(tmp_path / "t", 15)
    batch = 2

    def loader(rank: int, width: int) -> DataLoader:
        sampler = DistributedSampler(data, num_replicas=width, rank=rank, shuffle=True, seed=7, drop_last=True)
        return make_resumable(DataLoader(data, batch_size=batch, sampler=sampler, drop_last=True))

    def windows(b) -> list[tuple[int, ...]]:
        return [tuple(row.tolist()) for row in b["input_ids"]]

    before = []
    for rank in range(2):
        it = iter(loader(rank, 2))
        before += [w for _ in range(3) for w in windows(next(it))]
    resumed = loader(0, 1)
    resumed.sampler.resume(0, 3 * batch * 2)
    after = [w for b in resumed for w in windows(b)]
    order = resumed.sampler.global_order()
    every = [tuple(data[i]["input_ids"].tolist()) for i in order]
    consumed = 3 * batch * 2
    assert len(set(order)) == len(order) == len(data), "one replica now: the whole permutation, no padding"
    assert sorted(before) == sorted(every[:consumed]), "the two replicas read the epoch's first windows"
    assert after == every[consumed : consumed + len(after)], "the resumed replica continues the same order"
    assert len(every) - consumed - len(after) < batch, "only a last partial batch is dropped (drop_last)"
