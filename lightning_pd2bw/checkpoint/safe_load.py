"""The trust boundary of loading a checkpoint: nothing in it runs code.

A checkpoint directory is data, possibly from someone else. Every pickle this package reads from one goes through
here: Lightning's part (``trainer.pt``) with ``torch.load(weights_only=True)`` (tensors, containers and numbers;
a class of your own in ``hyper_parameters`` must be allowed with ``torch.serialization.add_safe_globals``), DCP's
index (``.metadata``) through an unpickler that admits DCP's own metadata classes only, checked before DCP reads it,
and the entries DCP stores as bytes (optimizer groups, callback states) with ``weights_only=True`` too
(``SafeLoadPlanner``; DCP's own planner loads them with ``weights_only=False``). A file that asks for anything else
is refused, naming the file and what it asked for (``UnreadableCheckpoint``), never skipped in silence.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

from ..errors import Refusal

METADATA_FILE = ".metadata"
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
_METADATA_GLOBALS = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class UnreadableCheckpoint(Refusal, ValueError):
    """A published checkpoint this version cannot read or will not trust: a damaged manifest, another format, or a
    file that would run code when loaded. Never passed over in silence (``ckpt_path="last"`` refuses it by name
    rather than resume from an older one or from step 0)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Admits the classes a DCP ``.metadata`` is made of, and nothing else (no callable of the attacker's choice)."""

    def find_class(self, module: str, name: str) -> Any:
        torch_value = getattr(torch, name, None) if module == "torch" else None
        if (
            module in _METADATA_MODULES
            or (module, name) in _METADATA_GLOBALS
            or isinstance(torch_value, (torch.dtype, torch.memory_format, torch.layout))
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not one of torch.distributed.checkpoint's metadata types")


def check_metadata(folder: Path) -> None:
    """Refuse a ``.metadata`` that asks for anything but DCP's metadata classes (before DCP unpickles it)."""
    file = folder / METADATA_FILE
    try:
        _MetadataUnpickler(io.BytesIO(file.read_bytes())).load()
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint {str(folder)!r} has no {METADATA_FILE}; it is incomplete") from None
    except Exception as error:
        raise UnreadableCheckpoint(
            f"checkpoint {str(folder)!r}: {METADATA_FILE} was refused ({error}): loading it would run code or it is "
            "damaged; use another checkpoint"
        ) from None


def read_metadata(folder: Path) -> Any:
    """DCP's index of ``folder``'s entries, once ``check_metadata`` admitted it."""
    check_metadata(folder)
    return FileSystemReader(folder).read_metadata()


def refusal(error: BaseException) -> str:
    """The line of torch's weights-only refusal that names what the pickle asked for."""
    lines = str(error).splitlines()
    found = next((line for line in lines if "GLOBAL" in line or "Unsupported" in line), lines[0] if lines else "")
    return found.strip()[:300]


def failures_of(error: BaseException) -> list[BaseException]:
    """What DCP's ``CheckpointException`` wraps (what each rank's planner or writer raised); none for others."""
    failures = getattr(error, "failures", None) or {}
    inner = (failure[0] if isinstance(failure, tuple) else failure for failure in failures.values())
    return [e for e in inner if isinstance(e, BaseException)]


def unwrapped(error: BaseException) -> UnreadableCheckpoint | None:
    """The refusal inside DCP's ``CheckpointException``, if any."""
    return next((e for e in failures_of(error) if isinstance(e, UnreadableCheckpoint)), None)


def load_object(file: Path, what: str = "checkpoint") -> Any:
    """``torch.load(file, weights_only=True)``; a file asking for other types is refused, naming it and the fix."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        raise UnreadableCheckpoint(
            f"{what} {str(file)!r} was refused: it asks for a type torch.load(weights_only=True) does not load "
            f"({refusal(error)}). Loading a checkpoint never runs code from it: if you wrote it and "
            "trust it, allow your class with torch.serialization.add_safe_globals([YourClass])"
        ) from None
    except Exception as error:
        raise UnreadableCheckpoint(f"{what} {str(file)!r} cannot be read ({error}); use another checkpoint") from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner over a flat request (``flatten_state_dict=False``, as this package loads), but its byte
    entries (optimizer groups, callback states) load with ``weights_only=True``."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            self.state_dict[fqn] = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            raise UnreadableCheckpoint(
                f"entry {fqn!r} cannot be read: refused by torch.load(weights_only=True) ({refusal(error)})"
            ) from None
