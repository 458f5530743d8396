"""How the engine reports what it does, without importing who listens (``observe/`` holds the listeners).

The engine and its stage executor call three optional observers, each a small protocol:

- ``Progress``: ticked before every action with the action (or a phase's name). The default here only counts;
  ``observe.watchdog.Watchdog`` reads one from its own thread to name where a hung rank stopped.
- ``ActionRecorder``: stamps each action's start and end (``observe.timeline.Recorder``: the Gantt chart and the
  Chrome trace).
- ``SavedTensorMeter``: sees every tensor autograd saves for the backward (``observe.activations.ActivationMeter``:
  the stash's bytes as autograd holds them).

Attach them with ``engine.observe(recorder=..., meter=...)`` or pass ``progress=`` to the engine. A driver that
agrees on stopping (Lightning's SIGTERM) sets ``engine.stop_flag``, a ``StopFlag`` the program calls at each
step's ``FLAG`` and at the run's ``LAST_FLAG`` (``schedules/program.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch


class StopFlag(Protocol):
    """The driver's stop agreement over every rank (``lightning/preemption.py``): ``check`` at each training step's
    head (the previous step's agreement read, this step's posted), ``settle`` at the run's end (the last read)."""

    def check(self) -> None: ...

    def settle(self) -> Any: ...


class Progress:
    """What the main thread is doing, ticked at every action; read by a watchdog thread."""

    def __init__(self) -> None:
        self.count = 0
        self.where: object = "starting"  # an action or a phase; formatted only when published

    def tick(self, where: object) -> None:
        self.count += 1
        self.where = where


class ActionRecorder(Protocol):
    def now(self) -> Any:
        """A start stamp (a clock reading or a device event)."""

    def action(self, action: Any, start: Any) -> None:
        """``action`` ran from ``start`` until now."""


class SavedTensorMeter(Protocol):
    def exclude(self, weights: Iterable[torch.Tensor]) -> None:
        """Never count these storages (weights; every version of them)."""

    def pack(self, tensor: torch.Tensor) -> Any: ...

    def unpack(self, packed: Any) -> torch.Tensor: ...

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks: ...


def pack_alias(tensor: torch.Tensor) -> torch.Tensor:
    # A fresh alias of what was saved: this weight version's values stay valid (its storage is not recycled while the
    # microbatch is in flight), and a later step on the parameter (another version's storage) trips no in-place check
    return tensor.data


def unpack_alias(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def stash_nbytes(entry: tuple[Any, Any]) -> int:
    """Bytes of the boundary tensors a stashed microbatch keeps (its stage inputs and outputs; the last stage's
    scaled loss), counted once per storage."""
    inputs, outputs = entry
    storages = {}
    for tensor in (*inputs, *(outputs if isinstance(outputs, tuple) else (outputs,))):
        if isinstance(tensor, torch.Tensor):
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(storages.values())
