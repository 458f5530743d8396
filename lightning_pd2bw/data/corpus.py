"""A byte-level text corpus. The embedded default is the Python standard library's own source,
which every machine with Python has: nothing is downloaded.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Sequence
from pathlib import Path

import torch

DEFAULT_MAX_BYTES = 4_000_000  # ~4 MB of Python source: plenty for tiny models, loads in well under a second


def stdlib_files() -> list[Path]:
    """The standard library's top-level ``.py`` files, sorted: the same list on every run."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.is_file())


def read_corpus(
    paths: Sequence[str | Path] | None = None,
    max_bytes: int | None = DEFAULT_MAX_BYTES,
    identity: dict[str, dict[str, int]] | None = None,
) -> torch.Tensor:
    """Concatenated bytes of ``paths`` (files or folders of ``*.txt``/``*.py``/``*.md``) or of the stdlib.

    Returns a uint8 tensor. Raises with the path named when a file is missing or the corpus is empty.
    ``identity``: filled with each file read, ``{path: {"bytes": its size, "crc32c": of the bytes used}}``, from
    the bytes as they are read (a resumed run compares it: ``TextDataModule.load_state_dict``).
    """
    files: list[Path] = []
    if paths:
        for entry in map(Path, paths):
            if entry.is_dir():
                files += sorted(p for p in entry.rglob("*") if p.suffix in {".txt", ".py", ".md"} and p.is_file())
            elif entry.is_file():
                files.append(entry)
            else:
                raise FileNotFoundError(f"data.paths: {str(entry)!r} does not exist; give text files or folders")
    else:
        files = stdlib_files()
    chunks, total = [], 0
    for path in files:
        data = path.read_bytes()
        size = len(data)
        if max_bytes is not None:
            data = data[: max_bytes - total]
        if identity is not None:
            import crc32c

            identity[str(path)] = {"bytes": size, "used": len(data), "crc32c": crc32c.crc32c(data)}
        chunks.append(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    corpus = b"\n".join(chunks)[:max_bytes]
    if not corpus:
        where = ", ".join(map(str, paths)) if paths else "the Python standard library"
        raise ValueError(f"the corpus from {where} is empty; give data.paths files that contain text")
    return torch.frombuffer(bytearray(corpus), dtype=torch.uint8)


def split(corpus: torch.Tensor, val_fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic split: the last ``val_fraction`` of the bytes is validation."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"data.val_fraction={val_fraction} must lie strictly between 0 and 1")
    cut = int(len(corpus) * (1.0 - val_fraction))
    return corpus[:cut], corpus[cut:]
