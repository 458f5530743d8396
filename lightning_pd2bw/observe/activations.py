"""Activation memory as autograd sees it: bytes saved for the backward, live now and at peak.

``ActivationMeter.hooks()`` is a ``saved_tensors_hooks`` context: every tensor autograd saves is
counted once per storage (views of one activation share it) until the graph that holds it is freed,
which for a pipeline is when the microbatch's backward has run. Weights are excluded (their storages
are registered with ``exclude``), so the figure is the stash: what 1F1B, GPipe or 2BW keep alive.
Tensors a checkpointed region keeps for recomputation are held by the checkpoint, not autograd, and
are not counted.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class _Held:
    """A saved tensor on autograd's graph; releases its count when the graph lets go of it."""

    __slots__ = ("meter", "tensor", "key")

    def __init__(self, meter: ActivationMeter, tensor: torch.Tensor, key: int) -> None:
        self.meter, self.tensor, self.key = meter, tensor, key

    def __del__(self) -> None:
        self.meter._release(self.key)


class ActivationMeter:
    """Counts the unique storages autograd holds for backward, excluding the given weights."""

    def __init__(self, weights: Iterable[torch.Tensor] = ()) -> None:
        self._weights: set[int] = set()
        self._live: dict[int, list[int]] = {}  # storage pointer -> [bytes, references]
        self.current = 0
        self.peak = 0
        self.exclude(weights)

    def exclude(self, weights: Iterable[torch.Tensor]) -> None:
        """Never count these tensors' storages (a stage's weights; every version of them)."""
        self._weights.update(w.untyped_storage().data_ptr() for w in weights)

    def reset_peak(self) -> None:
        self.peak = self.current

    def pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self._weights:
            return tensor
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [storage.nbytes(), 1]
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        else:
            entry[1] += 1
        return _Held(self, tensor, key)

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Held) else packed

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self._live[key]

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
