"""LightningDataModule over the byte corpus: LM (GPT) or masked-LM (BERT) windows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from ..errors import Refusal
from .corpus import DEFAULT_MAX_BYTES, read_corpus, split
from .datasets import LMDataset, MLMDataset


class DataChanged(Refusal, ValueError):
    """A resumed run's training data differ from the data its checkpoint was trained on."""


class TextDataModule(pl.LightningDataModule):
    """Text as bytes (or a local tokenizer's ids) in fixed windows: the embedded corpus, local files or a local
    Hugging Face dataset.

    Args:
        task: ``"lm"`` (next-token labels) or ``"mlm"`` (BERT's masking).
        seq_len: tokens per sample.
        batch_size: samples per data-parallel replica and step (micro_batch_size x num_microbatches under pd2bw).
        paths: local text files or folders (default: the embedded corpus, the Python standard library's source).
        val_fraction: the corpus's last fraction, held out for validation.
        max_bytes: read at most this many bytes of the corpus (None: all).
        shuffle: shuffle the training windows each epoch.
        seed: of the shuffle (and of MLM's masking).
        num_workers: DataLoader workers.
        hf_dataset: a local Hugging Face dataset directory instead of ``paths`` (never downloaded).
        hf_split: its split.
        text_column: its text column.
        tokenizer: a local ``tokenizer.json`` (or its directory); default: bytes.
        allow_changed: resume although the files differ from those the checkpoint recorded (their sizes and
            CRC32C); the data position then restarts at the start of the resumed epoch (the step, the weights and
            the schedules continue). Default: refused, naming the file.
    """

    def __init__(
        self,
        task: str = "lm",
        seq_len: int = 64,
        batch_size: int = 8,
        paths: Sequence[str] | None = None,
        val_fraction: float = 0.05,
        max_bytes: int | None = DEFAULT_MAX_BYTES,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        hf_dataset: str | None = None,
        hf_split: str = "train",
        text_column: str = "text",
        tokenizer: str | None = None,
        allow_changed: bool = False,
    ) -> None:
        super().__init__()
        if task not in ("lm", "mlm"):
            raise ValueError(f"data.task={task!r} is not supported; valid: lm, mlm")
        self.task, self.seq_len, self.batch_size = task, seq_len, batch_size
        self.paths, self.val_fraction, self.max_bytes = paths, val_fraction, max_bytes
        self.shuffle, self.seed, self.num_workers = shuffle, seed, num_workers
        self.hf_dataset, self.hf_split, self.text_column, self.tokenizer = hf_dataset, hf_split, text_column, tokenizer
        self.allow_changed = allow_changed
        self.identity: dict[str, dict[str, int]] = {}  # each file read: size, bytes used, CRC32C (read_corpus)
        if tokenizer and task == "mlm":
            raise ValueError("data.tokenizer with data.task=mlm is not supported (masking works on bytes); use task=lm")

    def corpus(self) -> torch.Tensor:
        """Bytes of the embedded corpus / local files / a local HF dataset, or their token ids."""
        from .hf import read_hf_texts, tokenize

        if self.hf_dataset:
            texts = read_hf_texts(self.hf_dataset, self.hf_split, self.text_column)
        elif self.tokenizer:
            corpus = read_corpus(self.paths, self.max_bytes, self.identity)
            texts = [bytes(corpus.tolist()).decode("utf-8", errors="replace")]
        else:
            return read_corpus(self.paths, self.max_bytes, self.identity)
        if self.tokenizer:
            return tokenize(texts, self.tokenizer)
        data = "\n".join(texts).encode("utf-8")[: self.max_bytes]
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint records of the data (Lightning saves it beside the weights): each file's identity."""
        return {"files": self.identity}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A resume reads the files the checkpoint was trained on, or is refused naming the first that differs
        (``allow_changed=True``: resumed with a warning, the data position restarting at its epoch's start)."""
        recorded, now = state_dict.get("files") or {}, self.identity
        changed = [(path, recorded.get(path), now.get(path)) for path in sorted(set(recorded) | set(now))]
        changed = [item for item in changed if item[1] != item[2]]
        if not recorded or not changed:
            return
        path, before, after = changed[0]
        what = (
            "is gone"
            if after is None
            else "is new"
            if before is None
            else f"has {after['bytes']:,} bytes, the checkpoint's run read {before['bytes']:,}"
            if after["bytes"] != before["bytes"]
            else "has the same size but other bytes (its CRC32C differs)"
        )
        message = f"data.paths: {path!r} {what} ({len(changed)} file(s) differ from the checkpoint's training data)"
        if not self.allow_changed:
            raise DataChanged(
                f"{message}; resuming would apply the old data position to other data. Resume with the same files, "
                "or set data.allow_changed=true (TextDataModule(allow_changed=True)) to resume on these: the step, "
                "weights and schedules continue, the data position restarts at the start of the resumed epoch"
            )
        import warnings

        warnings.warn(f"pd2bw: {message}; data.allow_changed=true: the data position restarts", stacklevel=2)
        self.data_changed = True  # read by the strategy's loader (lightning/data_position.py)

    def setup(self, stage: str | None = None) -> None:
        train, val = split(self.corpus(), self.val_fraction)
        if self.task == "lm":
            self.train_set, self.val_set = (
                LMDataset(train, self.seq_len),
                LMDataset(val, self.seq_len, name="validation"),
            )
        else:
            self.train_set = MLMDataset(train, self.seq_len, self.seed)
            self.val_set = MLMDataset(val, self.seq_len, self.seed + 1, name="validation")

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(
            self.train_set,
            self.batch_size,
            shuffle=self.shuffle,
            generator=generator,
            drop_last=True,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, self.batch_size, shuffle=False, drop_last=True, num_workers=self.num_workers)
