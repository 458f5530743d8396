"""Named presets with a clear error that lists the valid names (litgpt's ``Config.from_name``)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, TypeVar

T = TypeVar("T")


def from_name(table: dict[str, dict[str, Any]], cls: type[T], name: str, **overrides: Any) -> T:
    if name not in table:
        raise ValueError(f"unknown {cls.__name__} preset {name!r}; valid names: {', '.join(sorted(table))}")
    return replace(cls(**table[name]), **{k: v for k, v in overrides.items() if v is not None})


def pad_vocab(size: int, multiple: int = 64) -> int:
    """Round the vocabulary up to a multiple of 64 (faster matmuls; GPT-2's 50257 -> 50304)."""
    return -(-size // multiple) * multiple
