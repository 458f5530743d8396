"""An asynchronous save's life after the call returns: the previous checkpoint is removed only once its successor is
published, and a background write that fails is one message naming the folder, the free space and the checkpoint
kept (``BackgroundSaveFailed``), never a lost checkpoint or DCP's raw ``CheckpointException`` steps later.

Lightning's ``ModelCheckpoint`` removes the checkpoint it supersedes (``save_top_k``) and points ``last.ckpt`` at the
new one as soon as the save call returns, which under ``async_checkpoint`` is before a byte of it is on disk. Here the
removals and the links wait for the successor's publication (``Successor.removals``, ``Successor.links``); when the
write fails they are dropped, so ``last.ckpt`` still points at the checkpoint kept (``Successor.settle``)."""

from __future__ import annotations

import errno
import os
import shutil
from concurrent.futures import Future
from pathlib import Path

from ..errors import Refusal
from .safe_load import failures_of
from .store import remove


class BackgroundSaveFailed(Refusal, OSError):
    """A checkpoint written in the background failed; the previous complete checkpoint was kept (named)."""

    agreed = True  # every rank raises it at the same step (the agreement of lightning/preemption.py)


class Successor:
    """One asynchronous save in flight: its path, its future, and the removals waiting for it to be published."""

    def __init__(self, path: Path, future: Future, kept: Path | None) -> None:
        self.path, self.future, self.kept = path, future, kept
        self.removals: list[Path] = []
        self.links: list[tuple[Path, Path]] = []  # (link, target): made once the target is published

    def failed(self) -> bool:
        """The background write has ended with an error (non-blocking)."""
        return self.future.done() and self.future.exception() is not None

    def settle(self, is_global_zero: bool) -> Path:
        """Wait for the write. Published: the deferred removals run, and the new path is returned. Failed: they are
        dropped, links to the failed save are pointed back at the kept checkpoint, and ``BackgroundSaveFailed``
        names the folder, the free space and what was kept."""
        try:
            self.future.result()
        except BaseException as error:  # DCP's CheckpointException is a BaseException
            if is_global_zero:
                remove(self.path.with_name(self.path.name + ".tmp"))  # its partial files: the space they took back
            raise BackgroundSaveFailed(errno.EIO, failure_message(self.path, self.kept, error)) from error
        if is_global_zero:
            for link, target in self.links:
                if link.is_symlink() or link.is_file():
                    link.unlink()
                link.symlink_to(os.path.relpath(target, link.parent))
            for path in self.removals:
                if path != self.path and all(path != link for link, _ in self.links):
                    remove(path)
        return self.path


def failure_message(path: Path, kept: Path | None, error: BaseException) -> str:
    causes = [error, *failures_of(error)]
    cause = next((c for c in causes[1:] if isinstance(c, OSError)), causes[-1])
    full = any(getattr(c, "errno", None) == errno.ENOSPC or "unexpected pos" in str(c) for c in causes)
    folder = path.parent
    free = shutil.disk_usage(folder).free / 2**20 if folder.exists() else 0.0
    what = "no space left on the device" if full else f"{type(cause).__name__}: {str(cause)[:300]}"
    keep = (
        f"the previous checkpoint {str(kept)!r} is kept and complete (resume with ckpt_path=last or that path)"
        if kept is not None
        else "no earlier checkpoint of this run existed"
    )
    return (
        f"the background write of checkpoint {str(path)!r} failed ({what}; {free:.1f} MiB free in {str(folder)!r}). "
        f"It was not published; {keep}. The run stops here (async_checkpoint's policy: a failed write ends the run "
        "at the next step on every rank). Free space or fix the storage there, or save elsewhere "
        "(ModelCheckpoint(dirpath=...), pd2bw-train paths.output_dir=...)"
    )
