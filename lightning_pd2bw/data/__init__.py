"""Byte-level corpus (embedded default: the Python standard library's source), LM and MLM data."""

from .corpus import read_corpus, split
from .datamodule import TextDataModule
from .datasets import LMDataset, MLMDataset

__all__ = ["LMDataset", "MLMDataset", "TextDataModule", "read_corpus", "split"]
