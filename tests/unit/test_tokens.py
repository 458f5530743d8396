"""``pd2bw-prepare-data`` and ``data=tokens``: local texts to memory-mapped token shards, windows read back."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_pd2bw.data.hf import load_tokenizer
from lightning_pd2bw.data.prepare import EOT, main, prepare
from lightning_pd2bw.data.tokens import TokenDataset, read_index

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
    order = resumed.sampler.global_order().tolist()
    every = [tuple(data[i]["input_ids"].tolist()) for i in order]
    consumed = 3 * batch * 2
    assert len(set(order)) == len(order) == len(data), "one replica now: the whole permutation, no padding"
    assert sorted(before) == sorted(every[:consumed]), "the two replicas read the epoch's first windows"
    assert after == every[consumed : consumed + len(after)], "the resumed replica continues the same order"
    assert len(every) - consumed - len(after) < batch, "only a last partial batch is dropped (drop_last)"


@pytest.fixture(scope="module")
def lines(tmp_path_factory):
    """Documents of many lines, each larger than the chunks below (so each is tokenized in pieces)."""
    root = tmp_path_factory.mktemp("lines")
    words = "pipeline stage weight version microbatch gradient update flush double buffer".split()
    rng = np.random.default_rng(1)
    for i in range(5):
        # paragraphs (blank lines), lines ending in a space, an indented line: cuts only where tokens split anyway
        lines = [" ".join(rng.choice(words, size=12)) + (" " if j % 7 == 3 else "") for j in range(60)]
        body = "".join(line + ("\n\n" if j % 5 == 4 else "\n") for j, line in enumerate(lines)) + "  indented tail\n"
        (root / f"doc{i}.txt").write_text(f"Document {i}.\n{body}")
    return root


def test_streamed_in_pieces_over_two_workers_the_shards_are_the_document_stream(lines, tmp_path):
    """Chunks of 700 characters (each document in pieces, cut where a line starts with a character other than a
    space), tokenized by two processes and written in order: the train split is exactly the stream of whole
    documents tokenized one by one (``val_fraction=0``); with a validation fraction each chunk's last tokens go to
    validation and nothing is lost."""
    prepare(tmp_path / "tok", [lines], vocab_size=1000)  # large enough to merge runs of whitespace
    tokenizer = str(tmp_path / "tok" / "tokenizer.json")
    ids = stream(lines, load_tokenizer(tokenizer))
    index = prepare(tmp_path / "a", [lines], tokenizer=tokenizer, val_fraction=0.0, chunk_bytes=700, workers=2)
    train = np.concatenate([np.fromfile(tmp_path / "a" / n, dtype=np.uint16) for n, _ in index["splits"]["train"]])
    assert train.tolist() == ids and index["documents"] == 5 and index["tokens"] == len(ids)
    index = prepare(tmp_path / "b", [lines], tokenizer=tokenizer, val_fraction=0.1, chunk_bytes=700, workers=2)
    split = {
        s: np.concatenate([np.fromfile(tmp_path / "b" / n, dtype=np.uint16) for n, _ in index["splits"][s]]).tolist()
        for s in ("train", "val")
    }
    assert len(split["val"]) > 10 * len(ids) // 1000, "validation tokens from every chunk"
    assert sorted(split["train"] + split["val"]) == sorted(ids)
    rest = iter(ids)
    assert all(token in rest for token in split["train"]), "the train split keeps the stream's order"


def test_an_interrupted_run_continues_to_the_same_shards(lines, tmp_path):
    """Interrupted after 3 chunks (as Ctrl-C would), with a shard written past the record and a shard begun after
    it (what a kill between a write and its record leaves): the same command continues after the recorded chunks
    and writes byte for byte what an uninterrupted run writes."""
    settings = dict(vocab_size=300, val_fraction=0.05, chunk_bytes=500, shard_tokens=700, workers=2)
    whole = prepare(tmp_path / "whole", [lines], **settings)

    def interrupt(progress):
        if progress["chunks"] == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prepare(tmp_path / "cut", [lines], **settings, on_chunk=interrupt)
    assert not (tmp_path / "cut" / "index.json").exists() and (tmp_path / "cut" / "progress.json").exists()
    last = sorted((tmp_path / "cut").glob("train-*.bin"))[-1]
    with open(last, "ab") as handle:
        handle.write(b"\x01\x02" * 50)
    (tmp_path / "cut" / "train-00099.bin").write_bytes(b"\x03\x04" * 10)
    resumed = prepare(tmp_path / "cut", [lines], **settings)
    assert resumed == whole and not (tmp_path / "cut" / "progress.json").exists()
    assert sorted(p.name for p in (tmp_path / "cut").glob("*.bin")) == sorted(
        p.name for p in (tmp_path / "whole").glob("*.bin")
    )
    for file in (tmp_path / "whole").glob("*.bin"):
        assert (tmp_path / "cut" / file.name).read_bytes() == file.read_bytes(), file.name


def test_a_document_of_one_long_line_is_read_in_bounded_pieces(tmp_path):
    """A file without newlines (minified text) is cut before a word once it is four pieces long: memory stays
    bounded, and the pieces tokenize as the whole line does."""
    from lightning_pd2bw.data.prepare import pieces

    words = " ".join(["pipeline", "stage", "weight"] * 400)
    (tmp_path / "line.txt").write_text(words)
    got = list(pieces([tmp_path / "line.txt"], piece_chars=500))
    assert len(got) > 3 and max(len(text) for text, _ in got) <= 5 * 500 + 1
    assert "".join(text for text, _ in got) == words and [ends for _, ends in got][-1] is True
    assert all(not text.endswith(" ") for text, _ in got[:-1]), "cut before the space that starts a word"
    prepare(tmp_path / "tok", [tmp_path / "line.txt"], vocab_size=300)
    tokenizer = str(tmp_path / "tok" / "tokenizer.json")
    whole = load_tokenizer(tokenizer).encode(words).ids
    index = prepare(tmp_path / "cut", [tmp_path / "line.txt"], tokenizer=tokenizer, val_fraction=0.0, chunk_bytes=500)
    shards = [np.fromfile(tmp_path / "cut" / n, dtype=np.uint16) for n, _ in index["splits"]["train"]]
    assert np.concatenate(shards).tolist()[:-1] == whole, "the same tokens as the whole line (then end-of-text)"
