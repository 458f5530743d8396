"""Local Hugging Face data: a dataset on disk and a ``tokenizer.json`` (never fetched; offline only).

``datasets`` and ``tokenizers`` are optional (``pip install lightning_pd2bw[hf]``)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch


def _require(module: str, key: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ImportError(f"{key} needs the '{module}' package: pip install 'lightning_pd2bw[hf]'") from None


def read_hf_texts(path: str, split: str = "train", text_column: str = "text") -> list[str]:
    """Texts of a local dataset: a ``save_to_disk`` directory, or local files/dirs ``load_dataset`` reads."""
    return list(hf_texts(path, split, text_column))


def hf_texts(path: str, split: str = "train", text_column: str = "text") -> Iterator[str]:
    """``read_hf_texts``, one text at a time (the dataset stays memory-mapped by Arrow)."""
    datasets = _require("datasets", "data.hf_dataset")
    if not Path(path).exists():
        raise FileNotFoundError(
            f"data.hf_dataset={path!r} does not exist; give a local directory (datasets' save_to_disk, or data "
            "files). Nothing is downloaded here"
        )
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    if (Path(path) / "dataset_info.json").is_file() or (Path(path) / "dataset_dict.json").is_file():
        dataset = datasets.load_from_disk(path)
    else:
        dataset = datasets.load_dataset(path)
    if isinstance(dataset, datasets.DatasetDict):
        if split not in dataset:
            raise KeyError(f"data.hf_split={split!r} is not a split of {path!r}; splits: {', '.join(dataset)}")
        dataset = dataset[split]
    if text_column not in dataset.column_names:
        raise KeyError(
            f"data.text_column={text_column!r} is not a column of {path!r}; columns: {', '.join(dataset.column_names)}"
        )
    for batch in dataset.select_columns([text_column]).iter(batch_size=1024):
        yield from batch[text_column]


def load_tokenizer(path: str):
    tokenizers = _require("tokenizers", "data.tokenizer")
    file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"data.tokenizer={path!r}: no tokenizer.json there (a local file or directory)")
    return tokenizers.Tokenizer.from_file(str(file))


def tokenize(texts: Iterable[str], tokenizer_path: str) -> torch.Tensor:
    """One stream of token ids, documents joined as they come."""
    tokenizer = load_tokenizer(tokenizer_path)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(list(texts)):
        ids.extend(encoding.ids)
    return torch.tensor(ids, dtype=torch.int32)
