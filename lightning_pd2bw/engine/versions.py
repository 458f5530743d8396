"""Double-buffered weights: at most two versions of a stage's parameters, never more.

The optimizer always owns the same ``nn.Parameter`` objects. A version is a list of storages;
``use(version)`` points every parameter's ``.data`` at that version's storage (a pointer swap, no
copy). ``begin_update()`` recycles the storage of the version nobody needs any more: it copies the
newest version into it (one copy of the stage's weights per optimizer step) and points the
parameters there, so an in-place ``optimizer.step()`` turns it into the next version while the
in-flight microbatches keep reading the previous one.

Autocast note: a caching autocast region (``torch.autocast``'s default; Lightning's plugins turn the cache
off) keeps the low-precision cast of each parameter, keyed by the parameter, whose ``.data`` a swap
changes underneath it. Every swap therefore clears that cache, or a forward or a recomputation after a
swap would run on the other version's cast.

Autograd note: a forward saves views of ``p.data`` taken at forward time (e.g. ``weight.t()``),
while a few ops save ``p`` itself; the executor therefore selects the microbatch's version before
both its forward and its backward, so both kinds of saved tensors see the same version.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


class WeightVersions:
    """Keeps ``latest`` and, once an update has happened, ``latest - 1``."""

    MAX_VERSIONS = 2

    def __init__(self, parameters: Iterable[nn.Parameter], double_buffer: bool) -> None:
        self.parameters = list(parameters)
        self.double_buffer = double_buffer
        self.latest = 0  # absolute number of updates applied on this stage
        self.drain_base = 0  # value of `latest` at the last drain: relative version 0
        self._storages: dict[int, list[torch.Tensor]] = {0: [p.data for p in self.parameters]}
        self._active = 0
        self.max_versions_held = 1

    @property
    def num_versions(self) -> int:
        return len(self._storages)

    @property
    def held_bytes(self) -> int:
        """Bytes of every weight version held (the live parameters' storages included)."""
        return sum(t.numel() * t.element_size() for storages in self._storages.values() for t in storages)

    def reset_after_drain(self) -> None:
        """After a drain the version rule restarts: relative version 0 is the newest weights."""
        self.use_latest()
        for version in [v for v in self._storages if v != self.latest]:
            del self._storages[version]
        self.drain_base = self.latest

    def use(self, relative_version: int) -> None:
        """Point the parameters at ``drain_base + relative_version``."""
        version = self.drain_base + relative_version
        if version == self._active:
            return
        if version not in self._storages:
            raise RuntimeError(
                f"weight version {version} is not held on this stage (held: {sorted(self._storages)}); "
                "the schedule asked for a version the double buffer has already recycled"
            )
        for param, storage in zip(self.parameters, self._storages[version]):
            param.data = storage
        self._active = version
        torch.clear_autocast_cache()

    def weights_of(self, version: int) -> list[torch.Tensor]:
        """The storages of absolute version ``version`` (read-only use: e.g. the weights before an update)."""
        if version not in self._storages:
            raise RuntimeError(f"weight version {version} is not held on this stage (held: {sorted(self._storages)})")
        return self._storages[version]

    def use_latest(self) -> None:
        self.use(self.latest - self.drain_base)

    def begin_update(self) -> None:
        """Make the parameters writable as version ``latest + 1`` without touching in-flight versions."""
        self.use_latest()
        if not self.double_buffer:
            self._storages[self.latest + 1] = self._storages.pop(self.latest)
        else:
            stale = self.latest - 1
            if stale in self._storages:
                target = self._storages.pop(stale)
            else:
                target = [torch.empty_like(p.data) for p in self.parameters]
            if target:  # one fused copy of the stage's weights
                torch._foreach_copy_(target, [param.data for param in self.parameters])
            self._storages[self.latest + 1] = target
        for param, storage in zip(self.parameters, self._storages[self.latest + 1]):
            param.data = storage
        torch.clear_autocast_cache()  # the optimizer is about to change these weights in place
        self.latest += 1
        self._active = self.latest
        self.max_versions_held = max(self.max_versions_held, len(self._storages))
        assert len(self._storages) <= self.MAX_VERSIONS, "more than two weight versions held"
