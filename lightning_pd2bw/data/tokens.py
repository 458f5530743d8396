"""Tokenized corpora on disk: prepared once (``pd2bw-prepare-data``, ``prepare.py``), then memory-mapped windows.

    pd2bw-prepare-data OUT_DIR texts/ more.txt --vocab-size 50304      # trains a byte-level BPE on a sample
    pd2bw-train data=tokens data.path=OUT_DIR                          # train on it

``OUT_DIR`` holds ``tokenizer.json``, ``index.json`` (dtype, vocabulary, end-of-text id, shards per split) and
token shards ``train-00000.bin``, ``val-00000.bin``, ... (flat ``uint16`` ids, ``uint32`` for vocabularies over
65,536): nanoGPT's and Megatron's memory-mapped format, readable without any library. Documents are joined with
the end-of-text token. ``TokenDataset`` is map-style over fixed windows, so Lightning's ``DistributedSampler``
deals each replica its own windows, every stage of a pipeline sees the same batch, and the resumable sampler
(``lightning/data_position.py``) restores the exact position at any width.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from .prepare import INDEX


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
