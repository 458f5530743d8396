"""Byte-level corpus (embedded default: the Python standard library's source), LM and MLM data.

The corpus and datasets need only torch; ``TextDataModule`` (Lightning) is imported on first use."""

from .corpus import read_corpus, split
from .datasets import LMDataset, MLMDataset

__all__ = ["LMDataset", "MLMDataset", "TextDataModule", "read_corpus", "split"]


def __getattr__(name: str):
    if name == "TextDataModule":
        from .datamodule import TextDataModule

        return TextDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
