"""Checkpoints that prove their bytes: every file's CRC32C, computed while DCP writes it (no second pass over the
shards), recorded in the manifest and verified before a load, a resume or a consolidation reads the file.

Each rank's writer (``ChecksumWriter``, DCP's ``FileSystemWriter`` on a file system whose streams checksum what
passes through them) leaves ``<prefix>.crc32c.json`` beside its shards; rank 0 folds them into the manifest
(``collect``) and checksums the two small files it writes itself (``.metadata``, ``trainer.pt``). A reader verifies
only the files it is about to read (``verify``): a stage resuming reads its own shards, not the whole checkpoint.
CRC32C runs at about 10 GiB/s per core (the ``crc32c`` package, SSE4.2 / ARMv8 instructions): `docs/checkpoints.md`
states what it costs at the 13B stage's size."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from .safe_load import UnreadableCheckpoint

SIDECAR = ".crc32c.json"  # a rank's checksums, until rank 0 folds them into the manifest
CHUNK = 16 << 20


def crc32c(data: bytes | memoryview, value: int = 0) -> int:
    import crc32c as fast  # imported where used: `import lightning_pd2bw` needs nothing of it

    return fast.crc32c(data, value)


class _Summing:
    """A write stream that checksums what passes through it; everything else is the file's."""

    def __init__(self, stream: Any) -> None:
        self._stream, self.value = stream, 0

    def write(self, data: Any) -> int:
        self.value = crc32c(memoryview(data).cast("B"), self.value)
        return self._stream.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class _SummingFileSystem(FileSystem):
    def __init__(self) -> None:
        super().__init__()
        self.sums: dict[str, int] = {}

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            summing = _Summing(stream)
            yield summing
        self.sums[Path(path).name] = summing.value


class ChecksumWriter(FileSystemWriter):
    """DCP's file writer, checksumming each file as it writes it; the rank's sums go to a sidecar file."""

    def __init__(self, path: Any, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = _SummingFileSystem()

    def write_data(self, plan: Any, planner: Any) -> Any:
        written = super().write_data(plan, planner)
        written.wait()  # DCP's file writer finishes before it returns: the sums are complete
        sidecar = Path(self.path) / f"{plan.storage_data.prefix}{SIDECAR}"
        sidecar.write_text(json.dumps(self.fs.sums))
        return written


def file_crc32c(file: Path) -> int:
    value = 0
    with open(file, "rb") as handle:
        while chunk := handle.read(CHUNK):
            value = crc32c(chunk, value)
    return value


def collect(folder: Path) -> dict[str, int]:
    """Rank 0, once every rank has written: the ranks' sums (their sidecars removed) and the sums of the files
    written outside DCP's writers (read back: small)."""
    sums: dict[str, int] = {}
    for sidecar in sorted(folder.glob(f"*{SIDECAR}")):
        sums.update(json.loads(sidecar.read_text()))
        sidecar.unlink()
    for file in folder.iterdir():
        if file.is_file() and file.name not in sums:
            sums[file.name] = file_crc32c(file)
    return sums


def verify(folder: Path, manifest: dict[str, Any], names: Iterable[str]) -> None:
    """The files ``names`` of the checkpoint in ``folder`` hold the bytes the manifest's checksums were taken of,
    or ``UnreadableCheckpoint`` names the file (a checkpoint written before checksums were recorded is read as is)."""
    for name in sorted(set(names)):
        expected = manifest["files"].get(name, {}).get("crc32c")
        if expected is not None and file_crc32c(folder / name) != expected:
            raise UnreadableCheckpoint(
                f"checkpoint {str(folder)!r} is damaged: {name}'s bytes changed after it was written (its CRC32C "
                "differs from the manifest's); it was not read. Use another checkpoint (pass it as ckpt_path, or "
                "move this one away so that ckpt_path='last' finds the one before)"
            )
