"""Tokenized corpora on disk: prepared once (``pd2bw-prepare-data``), then memory-mapped windows.

    pd2bw-prepare-data OUT_DIR texts/ more.txt --vocab-size 50304      # trains a byte-level BPE on the spot
    pd2bw-prepare-data OUT_DIR texts/ --tokenizer tokenizer.json       # a local tokenizer (never fetched)
    pd2bw-prepare-data OUT_DIR --hf-dataset ./my_dataset --text-column text
    pd2bw-train data=tokens data.path=OUT_DIR                          # train on it

``OUT_DIR`` holds ``tokenizer.json``, ``index.json`` (dtype, vocabulary, end-of-text id, shards per split) and
token shards ``train-00000.bin``, ``val-00000.bin``, ... (flat ``uint16`` ids, ``uint32`` for vocabularies over
65,536): nanoGPT's and Megatron's memory-mapped format, readable without any library. Documents are joined with
the end-of-text token. ``TokenDataset`` is map-style over fixed windows, so Lightning's ``DistributedSampler``
deals each replica its own windows, every stage of a pipeline sees the same batch, and the resumable sampler
(``resume.py``) restores the exact position at any width.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

INDEX = "index.json"
TOKENIZER = "tokenizer.json"
EOT = "<|endoftext|>"


def _texts(inputs: Sequence[str | Path]) -> Iterator[str]:
    """The documents of local text files (directories: every file below them, in sorted order)."""
    for item in inputs:
        path = Path(item)
        if not path.exists():
            raise FileNotFoundError(f"pd2bw-prepare-data: {item} does not exist (local text files or directories)")
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for file in files:
            yield file.read_text(encoding="utf-8", errors="replace")


def _tokenizer(texts: list[str], tokenizer: str | None, vocab_size: int) -> Any:
    from .hf import _require, load_tokenizer

    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    tokenizers = _require("tokenizers", "pd2bw-prepare-data")
    trained = tokenizers.ByteLevelBPETokenizer()
    trained.train_from_iterator(texts, vocab_size=vocab_size, special_tokens=[EOT], show_progress=False)
    return trained._tokenizer


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
) -> dict[str, Any]:
    """Tokenize local texts (or a local Hugging Face dataset) into ``out``; returns the index."""
    from .hf import read_hf_texts

    if not inputs and not hf_dataset:
        raise ValueError("pd2bw-prepare-data needs text files/directories or --hf-dataset DIR")
    texts = list(_texts(inputs)) + (read_hf_texts(hf_dataset, text_column=text_column) if hf_dataset else [])
    model = _tokenizer(texts, tokenizer, vocab_size)
    eot = model.token_to_id(EOT)
    if eot is None:
        eot = model.get_vocab_size()  # a tokenizer without one: the next id, counted in the vocabulary
    vocab = max(model.get_vocab_size(), eot + 1)
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    ids = []
    for encoding in model.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eot)
    tokens = np.asarray(ids, dtype=dtype)
    val = int(len(tokens) * val_fraction)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save(str(out / TOKENIZER))
    splits: dict[str, list[list[Any]]] = {}
    for split, part in (("train", tokens[: len(tokens) - val]), ("val", tokens[len(tokens) - val :])):
        splits[split] = []
        for i, start in enumerate(range(0, len(part), shard_tokens)):
            name = f"{split}-{i:05d}.bin"
            part[start : start + shard_tokens].tofile(out / name)
            splits[split].append([name, int(min(shard_tokens, len(part) - start))])
    index = {"dtype": np.dtype(dtype).name, "vocab_size": vocab, "eot_id": eot, "tokenizer": TOKENIZER}
    index |= {"documents": len(texts), "tokens": int(len(tokens)), "splits": splits}
    (out / INDEX).write_text(json.dumps(index, indent=1))
    return index


def read_index(path: str | Path) -> dict[str, Any]:
    file = Path(path) / INDEX
    if not file.is_file():
        raise FileNotFoundError(
            f"data.path={str(path)!r} holds no tokenized corpus ({INDEX} missing). Prepare one with: "
            f"pd2bw-prepare-data {path} YOUR_TEXT_FILES_OR_DIRS [--tokenizer tokenizer.json | --vocab-size N]"
        )
    return json.loads(file.read_text())


class TokenDataset(Dataset):
    """Windows of ``seq_len + 1`` tokens (inputs and next-token labels), each inside one shard; memory-mapped."""

    def __init__(self, path: str | Path, seq_len: int, split: str = "train") -> None:
        self.path, self.seq_len, self.split = Path(path), seq_len, split
        index = read_index(path)
        self.vocab_size, self.dtype = index["vocab_size"], np.dtype(index["dtype"])
        self.shards = [(name, tokens // (seq_len + 1)) for name, tokens in index["splits"][split]]
        self.starts = np.cumsum([0] + [count for _, count in self.shards])
        if self.starts[-1] == 0:
            raise ValueError(
                f"data.path={str(path)!r}: the {split} split has no window of seq_len + 1 = {seq_len + 1} tokens; "
                "prepare more text or a larger --val-fraction, or lower data.seq_len"
            )
        self._maps: dict[str, np.memmap] = {}

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getstate__(self) -> dict[str, Any]:  # DataLoader workers open their own maps
        return {**self.__dict__, "_maps": {}}

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        shard = int(np.searchsorted(self.starts, index, side="right") - 1)
        name = self.shards[shard][0]
        tokens = self._maps.get(name)
        if tokens is None:
            tokens = self._maps[name] = np.memmap(self.path / name, dtype=self.dtype, mode="r")
        start = (index - int(self.starts[shard])) * (self.seq_len + 1)
        window = torch.from_numpy(tokens[start : start + self.seq_len + 1].astype(np.int64))
        return {"input_ids": window[:-1], "labels": window[1:]}


class TokenDataModule(pl.LightningDataModule):
    """``data=tokens``: train/validation loaders over a prepared corpus; ``batch_size`` is per replica."""

    def __init__(
        self,
        path: str,
        seq_len: int = 2048,
        batch_size: int = 8,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.path, self.seq_len, self.batch_size = path, seq_len, batch_size
        self.shuffle, self.seed, self.num_workers = shuffle, seed, num_workers

    @property
    def vocab_size(self) -> int:
        return int(read_index(self.path)["vocab_size"])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            TokenDataset(self.path, self.seq_len, "train"),
            self.batch_size,
            shuffle=self.shuffle,
            generator=torch.Generator().manual_seed(self.seed),
            drop_last=True,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        data = TokenDataset(self.path, self.seq_len, "val")
        return DataLoader(data, self.batch_size, shuffle=False, drop_last=True, num_workers=self.num_workers)


def main(argv: list[str] | None = None) -> None:
    """``pd2bw-prepare-data OUT [INPUTS...]``: tokenize local texts into memory-mapped shards for ``data=tokens``."""
    parser = argparse.ArgumentParser(prog="pd2bw-prepare-data", description=main.__doc__)
    parser.add_argument("out", help="the directory to write (tokenizer.json, index.json, *.bin shards)")
    parser.add_argument("inputs", nargs="*", help="local text files or directories (every file below them)")
    parser.add_argument("--tokenizer", help="a local tokenizer.json (or its directory); default: train a BPE here")
    parser.add_argument("--vocab-size", type=int, default=50304, help="of the tokenizer trained here")
    parser.add_argument("--hf-dataset", help="a local Hugging Face dataset directory (never downloaded)")
    parser.add_argument("--text-column", default="text")
    parser.add_argument("--val-fraction", type=float, default=0.005)
    parser.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per shard file")
    args = parser.parse_args(argv)
    index = prepare(
        args.out,
        args.inputs,
        tokenizer=args.tokenizer,
        vocab_size=args.vocab_size,
        hf_dataset=args.hf_dataset,
        text_column=args.text_column,
        val_fraction=args.val_fraction,
        shard_tokens=args.shard_tokens,
    )
    shards = {split: len(files) for split, files in index["splits"].items()}
    print(
        f"{args.out}: {index['documents']} documents, {index['tokens']:,} tokens ({index['dtype']}, vocabulary "
        f"{index['vocab_size']:,}), shards {shards}; train with: pd2bw-train data=tokens data.path={args.out} "
        f"model.config.vocab_size={index['vocab_size']} (or larger)"
    )


if __name__ == "__main__":
    main()
