"""Double-buffered weights: at most two versions of a stage's parameters, never more.

The optimizer always owns the same ``nn.Parameter`` objects. A version is a list of storages;
``use(version)`` points every parameter's ``.data`` at that version's storage (a pointer swap, no
copy). ``begin_update()`` recycles the storage of the version nobody needs any more: it copies the
newest version into it (one copy of the stage's weights per optimizer step) and points the
parameters there, so an in-place ``optimizer.step()`` turns it into the next version while the
in-flight microbatches keep reading the previous one.

Mixed-precision weights (``compute_dtype``, e.g. bfloat16 under ``bf16-mixed``; Megatron's bf16 parameters over
fp32 main parameters): the versions are held in ``compute_dtype`` and one float32 *master* copy holds the newest
version's values. Forwards and backwards run on a version (nothing cast per microbatch, nothing stashed but
what the layers save); everything else sees the master: the update (``use_writable``: hooks, clipping, the
step, the delay correction, the sharded broadcasts) and whatever runs between the engine's calls (``rest``:
checkpoint saves and loads, callbacks), so a write there is never lost. The newest version is cast from the
master when compute next asks for it (``use``: one cast per update, not one per microbatch). Gradients are the
master's dtype: autograd adds each microbatch's ``compute_dtype`` gradient into the float32 ``.grad`` the
engine keeps attached (one fused read-add-write; ``grad_buckets.py``).

With the optimizer sharded over replicas (``sharding.py``), a replica keeps the float32 master of the parameters it
owns only (``owned``: Megatron's distributed optimizer shards its fp32 main parameters the same way): another
replica's parameter lives in the versions alone, its writable copy is the newest version's storage (at
``begin_update`` a copy of the version before, so hooks and callbacks read the weights as they are), and after the
step its owner casts the master into its own newest version and broadcasts that (``publishable``), in the compute
dtype, into the others' newest version. Every replica then holds exactly what it would have cast from a master of
its own: the rule is unchanged bit for bit, and a stage holds ``w - 1`` of every ``w`` float32 masters fewer.

Autocast note: a caching autocast region (``torch.autocast``'s default; Lightning's plugins turn the cache
off) keeps the low-precision cast of each parameter, keyed by the parameter, whose ``.data`` a swap
changes underneath it. Every swap therefore clears that cache, or a forward or a recomputation after a
swap would run on the other version's cast.

Autograd note: a forward saves views of ``p.data`` taken at forward time (e.g. ``weight.t()``),
while a few ops save ``p`` itself; the executor therefore selects the microbatch's version before
both its forward and its backward, so both kinds of saved tensors see the same version.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

MASTER = -1  # ``_active`` while the parameters point at the master copy


class WeightVersions:
    """Keeps ``latest`` and, once an update has happened, ``latest - 1`` (and, with ``compute_dtype``, the master
    copy of ``latest``)."""

    MAX_VERSIONS = 2

    def __init__(
        self,
        parameters: Iterable[nn.Parameter],
        double_buffer: bool,
        compute_dtype: torch.dtype | None = None,
        owned: Iterable[nn.Parameter] | None = None,
    ) -> None:
        """``owned``: the parameters whose float32 master this replica keeps (the sharded optimizer's share and
        the parameters no optimizer steps); None: all of them."""
        self.parameters = list(parameters)
        self._owned_only = owned is not None
        self.double_buffer = double_buffer
        self.latest = 0  # absolute number of updates applied on this stage
        self.drain_base = 0  # value of `latest` at the last drain: relative version 0
        # the float32 master of each parameter (None: another replica owns it; its values live in the versions)
        self.master: list[torch.Tensor | None] | None = None
        self.compute_dtype = compute_dtype if _casts(self.parameters, compute_dtype) else None
        if self.compute_dtype is None:
            self._storages: dict[int, list[torch.Tensor]] = {0: [p.data for p in self.parameters]}
            self._active = 0
        else:
            for param in self.parameters:  # torch >= 2.10: a float32 .grad (the main gradient) on a bf16 version
                if hasattr(param, "grad_dtype"):
                    param.grad_dtype = None
            kept = None if owned is None else {id(p) for p in owned}
            masters = [p.data for p in self.parameters]
            self._storages = {0: [torch.empty_like(t, dtype=self.compute_dtype) for t in masters]}
            self.master = [t if kept is None or id(p) in kept else None for p, t in zip(self.parameters, masters)]
            for index in self._unmastered:
                self._storages[0][index].copy_(masters[index])  # its only copy from now on
            self._point(self.master, MASTER)
        # versions whose compute copy the master may have moved past (at rest anything may write it: a load)
        self._stale: set[int] = {0} if self.master is not None else set()
        self.max_versions_held = 1

    @property
    def mixed(self) -> bool:
        """Versions in ``compute_dtype`` over a float32 master copy."""
        return self.master is not None

    @property
    def _unmastered(self) -> list[int]:
        """Indices of the parameters whose master another replica keeps."""
        return [i for i, t in enumerate(self.master or []) if t is None]

    @property
    def sharded_master(self) -> bool:
        """Do the stage's replicas each keep the float32 masters of their own parameters only (``owned`` given, mixed
        weights)? The same on every replica of a stage, whatever it owns (the broadcasts' dtype depends on it)."""
        return self._owned_only and self.master is not None

    def unmastered(self) -> list[nn.Parameter]:
        """The parameters whose float32 master another replica keeps (a checkpoint takes them from their owner)."""
        return [self.parameters[i] for i in self._unmastered]

    @property
    def num_versions(self) -> int:
        return len(self._storages)

    @property
    def held_bytes(self) -> int:
        """Bytes of every weight version held (the live parameters' storages included) and of the master copy."""
        held = [t for storages in self._storages.values() for t in storages]
        held += [t for t in self.master or [] if t is not None]
        return sum(t.numel() * t.element_size() for t in held)

    @property
    def master_bytes(self) -> int:
        """Bytes of the float32 masters this replica keeps (0: no mixed weights)."""
        return sum(t.numel() * t.element_size() for t in self.master or [] if t is not None)

    def reset_after_drain(self) -> None:
        """After a drain the version rule restarts: relative version 0 is the newest weights."""
        self.use_writable()
        for version in [v for v in self._storages if v != self.latest]:
            del self._storages[version]
        self.drain_base = self.latest

    def use(self, relative_version: int) -> None:
        """Point the parameters at ``drain_base + relative_version`` (for compute: a forward, a backward)."""
        version = self.drain_base + relative_version
        if version == self._active:
            return
        if version not in self._storages:
            raise RuntimeError(
                f"weight version {version} is not held on this stage (held: {sorted(self._storages)}); "
                "the schedule asked for a version the double buffer has already recycled"
            )
        if version in self._stale:
            self._refresh(version)
        self._point(self._storages[version], version)

    def use_latest(self) -> None:
        self.use(self.latest - self.drain_base)

    def use_writable(self) -> None:
        """Point the parameters at what the optimizer steps and the world outside the engine reads and writes:
        the master copy (mixed), else the newest version's storage."""
        if self.master is None:
            self.use_latest()
            return
        self._stale.add(self.latest)  # anything may write the master now
        if self._active != MASTER:
            self._point(self.master, MASTER)

    rest = use_writable  # between the engine's calls

    def weights_before_step(self, parameters: Sequence[nn.Parameter]) -> list[torch.Tensor]:
        """The values of ``parameters`` before the update about to be stepped (the delay correction's W(t)): the
        previous version's storages, or, mixed, a copy of the master (its compute copy is rounded)."""
        if self.master is not None:
            position = {id(p): i for i, p in enumerate(self.parameters)}
            masters = [self.master[position[id(p)]] for p in parameters]
            assert all(t is not None for t in masters), "the correction steps owned parameters only"
            return [t.clone() for t in masters]  # type: ignore[union-attr]
        before = dict(zip(map(id, self.parameters), self.weights_of(self.latest - 1)))
        return [before[id(p)] for p in parameters]

    def weights_of(self, version: int) -> list[torch.Tensor]:
        """The storages of absolute version ``version`` (read-only use: e.g. the weights before an update)."""
        if version not in self._storages:
            raise RuntimeError(f"weight version {version} is not held on this stage (held: {sorted(self._storages)})")
        return self._storages[version]

    def begin_update(self) -> None:
        """Make the parameters writable as version ``latest + 1`` without touching in-flight versions."""
        if self.master is None:
            self.use_latest()
        elif self.latest in self._stale and self.double_buffer:  # in-flight microbatches may still ask for it
            self._refresh(self.latest)
        if not self.double_buffer:
            self._storages[self.latest + 1] = self._storages.pop(self.latest)
        else:
            stale = self.latest - 1
            if stale in self._storages:
                target = self._storages.pop(stale)
            else:
                target = [torch.empty_like(t) for t in self._storages[self.latest]]
            if target and self.master is None:  # one fused copy of the stage's weights (mixed: cast when used)
                torch._foreach_copy_(target, [param.data for param in self.parameters])
            elif unmastered := self._unmastered:  # their writable copy starts as the weights are (the hooks read it)
                newest = self._storages[self.latest]
                torch._foreach_copy_([target[i] for i in unmastered], [newest[i] for i in unmastered])
            self._storages[self.latest + 1] = target
        self._stale &= set(self._storages)  # the recycled version's mark goes with it
        self.latest += 1
        self.max_versions_held = max(self.max_versions_held, len(self._storages))
        assert len(self._storages) <= self.MAX_VERSIONS, "more than two weight versions held"
        if self.master is not None:
            self._stale.add(self.latest)  # the optimizer steps the master; the new version's copy is cast when used
            self._point(self.master, MASTER)  # (a parameter with no master here: the new version's storage)
        else:
            self._point(self._storages[self.latest], self.latest)  # the optimizer changes these in place

    @torch.no_grad()
    def publishable(self, parameters: Sequence[nn.Parameter]) -> list[torch.Tensor]:
        """After the step, with the master sharded: the newest version's storages of ``parameters``, this replica's
        own cast from its master, the others' to be overwritten by their owners' (the broadcasts' messages)."""
        self._refresh(self.latest)
        position = {id(p): i for i, p in enumerate(self.parameters)}
        return [self._storages[self.latest][position[id(p)]] for p in parameters]

    def _refresh(self, version: int) -> None:
        """The compute copy of ``version`` cast from the master (the master may have changed since it was made)."""
        assert self.master is not None
        kept = [i for i, t in enumerate(self.master) if t is not None]
        storages = self._storages[version]
        if kept:
            torch._foreach_copy_([storages[i] for i in kept], [self.master[i] for i in kept])  # type: ignore[misc]
        self._stale.discard(version)

    def _point(self, storages: list[torch.Tensor | None], version: int) -> None:
        """Point the parameters at ``storages`` (MASTER: a parameter with no master here at the newest version's)."""
        newest = self._storages.get(self.latest)
        for index, (param, storage) in enumerate(zip(self.parameters, storages)):
            param.data = storage if storage is not None else newest[index]  # type: ignore[index]
        self._active = version
        torch.clear_autocast_cache()


def _casts(parameters: Sequence[nn.Parameter], compute_dtype: torch.dtype | None) -> bool:
    """Do ``parameters`` get versions in ``compute_dtype`` over a float32 master? (None, or all in it already: no)"""
    if compute_dtype is None or all(p.dtype == compute_dtype for p in parameters):
        return False
    wrong = [(i, p.dtype) for i, p in enumerate(parameters) if p.dtype != torch.float32]
    if wrong:
        index, dtype = wrong[0]
        raise ValueError(
            f"weight_dtype={compute_dtype} holds the weights' versions in {compute_dtype} over a float32 master copy, "
            f"but this stage's parameter {index} is {dtype}: keep the model in float32 (bf16-mixed converts nothing) "
            "or set weight_dtype=None"
        )
    return True
