"""``HostStager``: an asynchronous save's copy of a stage's state in host memory, kept and reused across saves.

``torch.distributed.checkpoint.async_save`` hands the state to a stager, then writes what the stager returned in the
background while training goes on. DCP's ``DefaultStager`` deep-copies the state dict; in torch 2.11 that copy fails
on any nested dict (``KeyError: <class 'type'>`` in ``_state_dict_stager``: seen on a lent H200 with torch
2.11.0+cu130, 2026-11-27), so every asynchronous checkpoint of a GPU run failed there. This stager walks dicts,
lists and tuples itself and copies each tensor into a host buffer of its own (pinned for a CUDA tensor, allocated by
the first save and reused by every later one); other values are deep-copied. Training is blocked for the copies
alone (``stage`` waits for them), then DCP writes the files in the background.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager


class HostStager(AsyncStager):
    _synchronize_after_execute = False  # ``stage`` returns once the copies are complete

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}  # the value's path in the state dict -> its host copy

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        devices: set[torch.device] = set()
        staged = self._copy(state_dict, (), devices)
        for device in devices:
            torch.cuda.synchronize(device)  # the non-blocking copies have landed before DCP reads them
        return staged

    def _copy(self, value: Any, path: tuple, devices: set[torch.device]) -> Any:
        if isinstance(value, torch.Tensor):
            buffer = self._buffers.get(path)
            if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
                buffer = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=value.is_cuda)
                self._buffers[path] = buffer
            buffer.copy_(value.detach(), non_blocking=value.is_cuda)
            if value.is_cuda:
                devices.add(value.device)
            return buffer
        if isinstance(value, dict):
            return {key: self._copy(item, (*path, key), devices) for key, item in value.items()}
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(self._copy(item, (*path, index), devices) for index, item in enumerate(value))
        return copy.deepcopy(value)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns with the copies complete."""

    def close(self) -> None:
        self._buffers.clear()

    @property
    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers.values())
