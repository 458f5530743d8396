"""Before a save writes anything, on every rank: every rank sees the folder rank 0 publishes in, and the save fits
the space free there. Each failure is raised on every rank alike (the checks are collective), naming the fix. And
while it writes: a device that fills up anyway is named as such (``out_of_space_named``)."""

from __future__ import annotations

import errno
import shutil
import socket
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import CheckpointException

from ..errors import Refusal
from .safe_load import failures_of


class OutOfSpace(Refusal, OSError):
    """A checkpoint that does not fit where it goes (``errno.ENOSPC``): the message names the folder and the space."""

    agreed = True  # raised by every rank alike (the checks are collective; DCP gathers every rank's write result)


SPACE_MARGIN = 1.05  # DCP's per-file headers and trainer.pt, over the tensors' bytes


def check_space(tmp: Path, stage: int, entries: dict[str, Any], gather: Callable[[Any], list[Any]]) -> None:
    """Before writing: the checkpoint's bytes (each stage's tensors once: replicas write one copy) fit the space
    free where it goes, or every rank raises ``OSError(ENOSPC)`` naming the folder, what the save needs and what
    is free; nothing is written and the previous checkpoint stays. Collective (one object gather), cheap."""
    own = {k: v.numel() * v.element_size() for k, v in entries.items() if isinstance(v, torch.Tensor)}
    written: dict[tuple[int, str], int] = {}  # replicas write a name once; each writes its own shard's names
    for other, sizes in gather((stage, own)):
        written.update({(other, name): size for name, size in sizes.items()})
    need = int(sum(written.values()) * SPACE_MARGIN)
    free = shutil.disk_usage(tmp.parent).free  # the parent: rank 0 removes tmp as soon as it refuses
    if need > free:
        raise OutOfSpace(
            errno.ENOSPC,
            f"No space left on the device for checkpoint {str(tmp.with_suffix(''))!r}: the save needs about "
            f"{need / 2**20:.1f} MiB and {free / 2**20:.1f} MiB are free in {str(tmp.parent)!r}. Nothing was "
            "written; the previous checkpoint is intact. Free space there, or save elsewhere "
            "(ModelCheckpoint(dirpath=...), pd2bw-train paths.output_dir=...)",
        )


SHARED_PROBE = ".pd2bw-shared-probe"
_shared_checked: set[Path] = set()  # checkpoint folders' parents every rank was shown to see


def check_shared(tmp: Path, is_global_zero: bool, gather: Callable[[Any], list[Any]]) -> None:
    """At the first save into a folder (unless ``check_shared_folder`` checked it at start-up): every rank must see
    the files rank 0 writes there (rank 0 alone lists, writes the manifest and publishes, so a folder local to each
    host silently loses the other hosts' shards). Collective (two object gathers), once per folder."""
    if tmp.parent.resolve() not in _shared_checked:
        _probe(tmp, tmp.parent.resolve(), is_global_zero, gather)


def check_shared_folder(folder: Path, is_global_zero: bool, gather: Callable[[Any], list[Any]]) -> None:
    """The same check at start-up, before the first step, in the folder checkpoints will be written to (rank 0
    creates it): a cluster whose checkpoint folder is local to each node learns it in seconds, not at the first save
    hours in. Collective."""
    folder = Path(folder)
    if is_global_zero:
        folder.mkdir(parents=True, exist_ok=True)
    gather(None)  # the folder exists before any rank looks
    if folder.resolve() not in _shared_checked:
        _probe(folder, folder.resolve(), is_global_zero, gather)


def _probe(where: Path, key: Path, is_global_zero: bool, gather: Callable[[Any], list[Any]]) -> None:
    """Rank 0 writes a random token into ``where``; every rank reads it back; a clear error on every rank names
    those that cannot."""
    probe = where / SHARED_PROBE
    token = None
    if is_global_zero:
        token = uuid.uuid4().hex
        probe.write_text(token)
    token = next(t for t in gather(token) if t is not None)
    sees = probe.is_file() and probe.read_text() == token
    seen = gather((sees, socket.gethostname()))
    if is_global_zero:
        probe.unlink()
    blind = [f"rank {rank} on {host}" for rank, (ok, host) in enumerate(seen) if not ok]
    if blind:
        raise RuntimeError(
            f"pd2bw: checkpoints need one folder every rank sees, but {', '.join(blind)} cannot see {str(where)!r}, "
            f"which rank {0} (on {seen[0][1]}) created: the checkpoint directory is local to each host. Point the "
            "checkpoint callback's dirpath (Hydra: paths.output_dir) at storage every node mounts (NFS, Lustre, a "
            "shared bucket mount)"
        )
    _shared_checked.add(key)


@contextmanager
def out_of_space_named(tmp: Path) -> Iterator[None]:
    """A write that fails because the device filled up (torch.save's ``unexpected pos``, DCP's or the OS's
    ENOSPC) raised as ``OSError(ENOSPC)`` naming the folder and what is free; the previous checkpoint is intact
    (this one is never published)."""
    try:
        yield
    except (OSError, RuntimeError, CheckpointException) as error:
        causes = [error, *failures_of(error)]  # DCP wraps each rank's failure
        full = any(getattr(c, "errno", None) == errno.ENOSPC or "unexpected pos" in str(c) for c in causes)
        free = shutil.disk_usage(tmp.parent).free if tmp.parent.exists() else 0
        if not full and not (any(isinstance(c, OSError) for c in causes) and free < 2**20):
            raise
        raise OutOfSpace(
            errno.ENOSPC,
            f"No space left on the device while writing checkpoint {str(tmp.with_suffix(''))!r}: "
            f"{free / 2**20:.1f} MiB free in {str(tmp.parent)!r} ({type(error).__name__}: {error}). The previous "
            "checkpoint is intact; this one was not published. Free space there, or save elsewhere "
            "(ModelCheckpoint(dirpath=...), pd2bw-train paths.output_dir=...)",
        ) from error
