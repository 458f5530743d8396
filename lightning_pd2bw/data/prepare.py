"""``pd2bw-prepare-data``: local texts to memory-mapped token shards, streamed (``tokens.py`` reads them).

    pd2bw-prepare-data OUT_DIR texts/ more.txt --vocab-size 50304      # trains a byte-level BPE on a sample
    pd2bw-prepare-data OUT_DIR texts/ --tokenizer tokenizer.json       # a local tokenizer (never fetched)
    pd2bw-prepare-data OUT_DIR --hf-dataset ./my_dataset --text-column text

The corpus never sits in memory: documents are read as they come (a file larger than a chunk in pieces, cut at a
lone newline between two characters that are not whitespace, where a byte-level tokenizer splits anyway), grouped into chunks
of about ``chunk_bytes``, tokenized by ``workers`` processes (a bounded number of chunks in flight, their results
written in order), and appended to shards of ``shard_tokens`` tokens as they finish. Each chunk's last
``val_fraction`` of tokens goes to the validation split, so validation text is drawn from across the corpus (for a
corpus of one chunk: its last tokens, as before). After every chunk ``progress.json`` records what is written; a
run interrupted anywhere (Ctrl-C, a kill) and started again with the same arguments continues after the last
recorded chunk, and its shards are byte for byte those of an uninterrupted run. ``index.json`` is written last.

Why not litdata's ``optimize``: its shards are litdata's own chunk format, read through its ``StreamingDataset``;
these are flat ``uint16``/``uint32`` token files (nanoGPT's and Megatron's format) that ``TokenDataset`` maps with
numpy and the resumable sampler indexes at any width, and that other tools read without a library. What
``optimize`` brings (parallel workers, bounded memory, writing as it goes) is here in a page.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

INDEX = "index.json"
TOKENIZER = "tokenizer.json"
EOT = "<|endoftext|>"
PROGRESS = "progress.json"
CHUNK_BYTES = 1 << 20  # text per unit of work (its tokens are written before the next one starts)
PIECE_CHARS = 1 << 18  # a document larger than this is tokenized in pieces
TOKENIZER_SAMPLE_BYTES = 64 << 20  # what a tokenizer trained here sees (the corpus's first documents)

Piece = tuple[str, bool]  # a document or a piece of one, and whether the document ends with it


def pieces(inputs: Sequence[str | Path], piece_chars: int = PIECE_CHARS) -> Iterator[Piece]:
    """The documents of local text files (directories: every file below them, in sorted order), a large file in
    pieces of about ``piece_chars`` characters."""
    for item in inputs:
        path = Path(item)
        if not path.exists():
            raise FileNotFoundError(f"pd2bw-prepare-data: {item} does not exist (local text files or directories)")
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            with open(file, encoding="utf-8", errors="replace") as handle:
                yield from _split_document(handle, piece_chars)


def _split_document(handle: Any, piece_chars: int) -> Iterator[Piece]:
    carry = ""
    while True:
        block = handle.read(piece_chars)
        if not block:
            yield carry, True
            return
        text = carry + block
        cut = _cut(text)
        if cut <= 0 and len(text) > 4 * piece_chars:  # a line longer than four pieces: cut before a word
            cut = _cut_at_word(text)
        if cut <= 0:  # no place to cut yet: keep reading
            carry = text
            continue
        yield text[:cut], False
        carry = text[cut:]


def _cut(text: str) -> int:
    """The last position after a lone newline, one with a character other than whitespace on both sides (0: none).
    A byte-level tokenizer splits there anyway; after a run of whitespace it would not (at the end of a piece the
    run is one pre-token, inside the text its last character joins the next word)."""
    at = len(text) - 1
    while True:
        at = text.rfind("\n", 0, at)
        if at <= 0:
            return 0
        if at + 1 < len(text) and not text[at + 1].isspace() and not text[at - 1].isspace():
            return at + 1


def _cut_at_word(text: str) -> int:
    """The last position before a single space between two words (the space starts the next word's token), else
    the end: memory stays bounded even for text without spaces."""
    at = len(text) - 1
    while (at := text.rfind(" ", 0, at)) > 0:
        if not text[at - 1].isspace() and at + 1 < len(text) and not text[at + 1].isspace():
            return at
    return len(text)


def chunks(documents: Iterable[Piece], chunk_bytes: int = CHUNK_BYTES) -> Iterator[list[Piece]]:
    """Consecutive pieces of about ``chunk_bytes`` characters together."""
    chunk: list[Piece] = []
    size = 0
    for piece in documents:
        chunk.append(piece)
        size += len(piece[0])
        if size >= chunk_bytes:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


# ---------------------------------------------------------------------------------------------- tokenizing
_WORKER: dict[str, Any] = {}


def _start_worker(tokenizer_json: str, eot: int, dtype: str, pooled: bool = False) -> None:
    if pooled:  # a forked worker: the processes are the parallelism (and the tokenizer's threads did not survive)
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import tokenizers

    _WORKER.update(tokenizer=tokenizers.Tokenizer.from_str(tokenizer_json), eot=eot, dtype=np.dtype(dtype))


def _encode(chunk: list[Piece]) -> np.ndarray:
    """A chunk's token ids, each finished document followed by the end-of-text id."""
    tokenizer, eot, dtype = _WORKER["tokenizer"], _WORKER["eot"], _WORKER["dtype"]
    parts = []
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # ids without offsets: 1.8x faster
    for (_, ends), encoding in zip(chunk, encode([text for text, _ in chunk])):
        parts.append(np.asarray(encoding.ids, dtype=dtype))
        if ends:
            parts.append(np.asarray([eot], dtype=dtype))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _encoded(chunk_list: Iterator[list[Piece]], setup: tuple[str, int, str], workers: int) -> Iterator[np.ndarray]:
    """Each chunk's ids, in order; ``workers`` processes with at most two chunks each in flight."""
    if workers <= 1:
        _start_worker(*setup)
        yield from (_encode(chunk) for chunk in chunk_list)
        return
    # fork: the workers share the parent's pages (spawn would import torch again in each); the tokenizer's own
    # threads do not survive a fork, so each worker tokenizes on one thread (the processes are the parallelism)
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    pool = ProcessPoolExecutor(workers, multiprocessing.get_context(method), _start_worker, (*setup, True))
    with pool:
        pending: deque = deque()
        for chunk in chunk_list:
            pending.append(pool.submit(_encode, chunk))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _tokenizer(documents: Callable[[], Iterator[Piece]], tokenizer: str | None, vocab_size: int) -> Any:
    """A local tokenizer, or a byte-level BPE trained on the corpus's first ``TOKENIZER_SAMPLE_BYTES``."""
    from .hf import _require, load_tokenizer

    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    tokenizers = _require("tokenizers", "pd2bw-prepare-data")

    def sample() -> Iterator[str]:
        seen = 0
        for text, _ in documents():
            yield text
            seen += len(text)
            if seen >= TOKENIZER_SAMPLE_BYTES:
                return

    trained = tokenizers.ByteLevelBPETokenizer()
    trained.train_from_iterator(sample(), vocab_size=vocab_size, special_tokens=[EOT], show_progress=False)
    return trained._tokenizer


# ---------------------------------------------------------------------------------------------- writing
class ShardWriter:
    """Appends one split's tokens to ``{split}-00000.bin``, ``{split}-00001.bin``, ... of ``shard_tokens`` each."""

    def __init__(self, out: Path, split: str, shard_tokens: int, dtype: np.dtype, shards: list[list[Any]]) -> None:
        self.out, self.split, self.shard_tokens, self.dtype = out, split, shard_tokens, dtype
        self.shards = shards  # [[name, tokens], ...]: what progress.json recorded (resume) or nothing
        for name, tokens in shards:  # a kill may have appended past the record: back to it
            with open(out / name, "r+b") as handle:
                handle.truncate(tokens * dtype.itemsize)
        for stale in out.glob(f"{split}-*.bin"):  # shards begun after the record
            if stale.name not in {name for name, _ in shards}:
                stale.unlink()

    def write(self, tokens: np.ndarray) -> None:
        while len(tokens):
            if not self.shards or self.shards[-1][1] >= self.shard_tokens:
                self.shards.append([f"{self.split}-{len(self.shards):05d}.bin", 0])
            name, held = self.shards[-1]
            part = tokens[: self.shard_tokens - held]
            with open(self.out / name, "ab") as handle:
                handle.write(part.tobytes())
            self.shards[-1][1] = held + len(part)
            tokens = tokens[len(part) :]


def _write_json(path: Path, value: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)  # never half written


def prepare(
    out: str | Path,
    inputs: Sequence[str | Path] = (),
    *,
    tokenizer: str | None = None,
    vocab_size: int = 50304,
    hf_dataset: str | None = None,
    text_column: str = "text",
    val_fraction: float = 0.005,
    shard_tokens: int = 1 << 28,
    chunk_bytes: int = CHUNK_BYTES,
    workers: int | None = None,
    on_chunk: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Tokenize local texts (or a local Hugging Face dataset) into ``out``, streaming; returns the index.
    ``on_chunk(progress)`` is called after each chunk is written (what ``progress.json`` holds, and the ``seconds``
    since the first); an exception from it interrupts the run as Ctrl-C would, and a new call continues it."""
    from .hf import hf_texts

    if not inputs and not hf_dataset:
        raise ValueError("pd2bw-prepare-data needs text files/directories or --hf-dataset DIR")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"--val-fraction {val_fraction} must be in [0, 1)")
    for item in inputs:
        if not Path(item).exists():
            raise FileNotFoundError(f"pd2bw-prepare-data: {item} does not exist (local text files or directories)")

    def documents() -> Iterator[Piece]:
        yield from pieces(inputs, min(chunk_bytes, PIECE_CHARS))
        if hf_dataset:
            yield from ((text, True) for text in hf_texts(hf_dataset, text_column=text_column))

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    settings = {
        "inputs": [str(Path(i).resolve()) for i in inputs],
        "hf_dataset": hf_dataset and str(Path(hf_dataset).resolve()),
        "text_column": text_column,
        "tokenizer": tokenizer and str(Path(tokenizer).resolve()),
        "vocab_size": vocab_size,
        "val_fraction": val_fraction,
        "shard_tokens": shard_tokens,
        "chunk_bytes": chunk_bytes,
    }
    progress = _resumable(out, settings)
    if progress is None:
        model = _tokenizer(documents, tokenizer, vocab_size)
        model.save(str(out / TOKENIZER))
        (out / INDEX).unlink(missing_ok=True)
        progress = {"settings": settings, "chunks": 0, "documents": 0, "tokens": 0, "splits": {"train": [], "val": []}}
    else:
        model = _tokenizer(documents, str(out / TOKENIZER), vocab_size)  # the one this run began with
    eot = model.token_to_id(EOT)
    if eot is None:
        eot = model.get_vocab_size()  # a tokenizer without one: the next id, counted in the vocabulary
    vocab = max(model.get_vocab_size(), eot + 1)
    dtype = np.dtype(np.uint16 if vocab <= 1 << 16 else np.uint32)
    writers = {s: ShardWriter(out, s, shard_tokens, dtype, progress["splits"][s]) for s in ("train", "val")}
    done = progress["chunks"]
    todo = (c for i, c in enumerate(chunks(documents(), chunk_bytes)) if i >= done)  # done ones: read, skipped
    counted: deque[int] = deque()  # the documents of each chunk handed to the workers and not yet written

    def counting(chunk_list: Iterator[list[Piece]]) -> Iterator[list[Piece]]:
        for chunk in chunk_list:
            counted.append(sum(ends for _, ends in chunk))
            yield chunk

    setup = (model.to_str(), eot, dtype.name)
    started = time.perf_counter()
    for ids in _encoded(counting(todo), setup, workers or os.cpu_count() or 1):
        val = int(round(len(ids) * val_fraction))
        writers["train"].write(ids[: len(ids) - val])
        writers["val"].write(ids[len(ids) - val :])
        progress["chunks"] += 1
        progress["documents"] += counted.popleft()
        progress["tokens"] += len(ids)
        _write_json(out / PROGRESS, progress)
        if on_chunk is not None:
            on_chunk(progress | {"seconds": time.perf_counter() - started})
    index = {"dtype": dtype.name, "vocab_size": vocab, "eot_id": eot, "tokenizer": TOKENIZER}
    index |= {"documents": progress["documents"], "tokens": progress["tokens"], "splits": progress["splits"]}
    _write_json(out / INDEX, index)
    (out / PROGRESS).unlink()
    return index


def _resumable(out: Path, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The progress of an interrupted run with the same settings, or None (a fresh start)."""
    file = out / PROGRESS
    if not file.is_file() or not (out / TOKENIZER).is_file():
        return None
    progress = json.loads(file.read_text())
    if progress.get("settings") != settings:
        print(f"pd2bw-prepare-data: {file} is from a run with other arguments; starting over")
        return None
    print(f"pd2bw-prepare-data: continuing an interrupted run after {progress['chunks']} chunks ({file})")
    return progress


def main(argv: list[str] | None = None) -> None:
    """``pd2bw-prepare-data OUT [INPUTS...]``: tokenize local texts into memory-mapped shards for ``data=tokens``,
    streaming in bounded memory over the cores; an interrupted run continues when started again."""
    parser = argparse.ArgumentParser(prog="pd2bw-prepare-data", description=main.__doc__)
    parser.add_argument("out", help="the directory to write (tokenizer.json, index.json, *.bin shards)")
    parser.add_argument("inputs", nargs="*", help="local text files or directories (every file below them)")
    parser.add_argument("--tokenizer", help="a local tokenizer.json (or its directory); default: train a BPE here")
    parser.add_argument("--vocab-size", type=int, default=50304, help="of the tokenizer trained here")
    parser.add_argument("--hf-dataset", help="a local Hugging Face dataset directory (never downloaded)")
    parser.add_argument("--text-column", default="text")
    parser.add_argument("--val-fraction", type=float, default=0.005, help="of each chunk's tokens")
    parser.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per shard file")
    parser.add_argument("--chunk-bytes", type=int, default=CHUNK_BYTES, help="text per unit of work")
    parser.add_argument("--workers", type=int, default=None, help="tokenizing processes (default: the cores)")
    args = parser.parse_args(argv)
    last = [0.0]

    def report(progress: dict[str, Any]) -> None:
        if progress["seconds"] - last[0] >= 10:
            last[0] = progress["seconds"]
            print(
                f"  {progress['chunks']} chunks, {progress['tokens']:,} tokens, {progress['seconds']:.0f} s", flush=True
            )

    index = prepare(
        args.out,
        args.inputs,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        hf_dataset=args.hf_dataset,
        text_column=args.text_column,
        val_fraction=args.val_fraction,
        shard_tokens=args.shard_tokens,
        chunk_bytes=args.chunk_bytes,
        workers=args.workers,
        on_chunk=report,
    )
    shards = {split: len(files) for split, files in index["splits"].items()}
    print(
        f"{args.out}: {index['documents']} documents, {index['tokens']:,} tokens ({index['dtype']}, vocabulary "
        f"{index['vocab_size']:,}), shards {shards}; train with: pd2bw-train data=tokens data.path={args.out} "
        f"model.config.vocab_size={index['vocab_size']} (or larger)"
    )


if __name__ == "__main__":
    main()
