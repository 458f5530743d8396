"""One ledger of what the pipeline keeps per batch between the batch's step and the end of its update.

A batch (numbered within a run, the stretch between two drains) is opened by its training step with the global
step it belongs to and the hyper-parameters every optimizer had then (its update, which 2BW applies one step
later, must use them). It then holds, until each is consumed: those hyper-parameters (taken by the update), its
mean loss being broadcast from the last stage (taken one step later under 2BW). A batch whose entries are all
consumed is closed.

Beside the entries, the ledger holds the per-batch state of this stage's work in flight, each popped when its
batch is done with it: the last stage's running sum of a batch's microbatch losses (``add_loss``) and the batches CHECK found
non-finite under ``on_nonfinite="skip"`` (``skip``); and ``fed``, the batches fed since the engine was built.

Bounded by construction: at most ``LIMIT`` batches are open (2BW: the batch two back waits for the end of its
update, which the head of the current step completes, the previous one for its update and loss, the current one);
opening one more is a bug and raises rather than grows. ``counters()`` reports what is held.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..layout import Layout

LIMIT = 4


@dataclass
class BatchEntry:
    global_step: int
    hparams: list[list[dict[str, Any]]] | None  # per optimizer, per param group; None once the update took it
    loss: tuple[torch.Tensor, Any] | None = None  # (value, the broadcast's work) in flight
    loss_expected: bool = field(default=True)

    def consumed(self) -> bool:
        return self.hparams is None and self.loss is None and not self.loss_expected


class BatchLedger:
    def __init__(self) -> None:
        self.batches: dict[int, BatchEntry] = {}
        self.next_batch = 0  # the next training step's batch number in this run
        self.fed = 0  # batches fed since the engine was built (train_batch's default global step)
        self.loss_sums: dict[int, torch.Tensor] = {}  # last stage: the sum of a batch's microbatch losses so far
        self.skipped: set[int] = set()  # CHECK found the batch non-finite under "skip": its CLIP and STEP do nothing
        self.skipped_updates: list[int] = []  # the global steps whose update was skipped (kept across drains)

    # ------------------------------------------------------------------ this stage's work in flight
    def add_loss(self, batch: int, loss: torch.Tensor) -> None:
        """Add a microbatch's loss (detached, in float32) to its batch's sum (last stage)."""
        total = self.loss_sums.get(batch)
        self.loss_sums[batch] = loss.detach().float() if total is None else total + loss.detach().float()

    def take_loss_sum(self, batch: int) -> torch.Tensor:
        return self.loss_sums.pop(batch)

    def skip(self, batch: int) -> None:
        self.skipped.add(batch)

    def is_skipped(self, batch: int) -> bool:
        return batch in self.skipped

    def take_skip(self, batch: int) -> bool:
        """Whether ``batch``'s update is skipped (its STEP: the batch leaves the set)."""
        if batch in self.skipped:
            self.skipped.discard(batch)
            return True
        return False

    def open(self, global_step: int, hparams: list[list[dict[str, Any]]]) -> int:
        """Open the next batch of the run; returns its number."""
        if len(self.batches) >= LIMIT:
            raise RuntimeError(
                f"pd2bw: {len(self.batches)} batches still held ({sorted(self.batches)}) when opening batch "
                f"{self.next_batch}: an update or a loss was never consumed (a pipeline bug)"
            )
        batch, self.next_batch = self.next_batch, self.next_batch + 1
        self.batches[batch] = BatchEntry(global_step, hparams)
        return batch

    def global_step(self, batch: int) -> int:
        """The Lightning step that fed ``batch`` (-1 once it is closed)."""
        entry = self.batches.get(batch)
        return entry.global_step if entry is not None else -1

    def take_hparams(self, batch: int) -> list[list[dict[str, Any]]]:
        entry = self.batches[batch]
        hparams, entry.hparams = entry.hparams, None
        assert hparams is not None, f"batch {batch}'s update ran twice"
        self._close_if_done(batch)
        return hparams

    def put_loss(self, batch: int, value: torch.Tensor, work: Any) -> None:
        entry = self.batches[batch]
        entry.loss, entry.loss_expected = (value, work), False

    def take_loss(self, batch: int) -> torch.Tensor | None:
        """``batch``'s mean loss once its broadcast completed (None: no such batch in this run)."""
        entry = self.batches.get(batch)
        if entry is None or entry.loss is None:
            return None
        (value, work), entry.loss = entry.loss, None
        work.wait()
        self._close_if_done(batch)
        return value

    def pending_losses(self) -> list[int]:
        return sorted(b for b, e in self.batches.items() if e.loss is not None)

    def restart(self) -> None:
        """After a drain: every batch is consumed; numbering starts again at 0."""
        left = {b: e for b, e in self.batches.items() if not e.consumed()}
        if any(e.hparams is not None or e.loss is not None for e in left.values()):
            raise RuntimeError(f"pd2bw: batches {sorted(left)} still hold an update or a loss after a drain")
        if self.loss_sums:
            raise RuntimeError(f"pd2bw: losses of batches {sorted(self.loss_sums)} are still held after a drain")
        self.batches.clear()
        self.skipped.clear()
        self.next_batch = 0

    def counters(self) -> dict[str, int]:
        """What is held now: open batches, updates waiting for their hyper-parameters, losses in flight."""
        entries = self.batches.values()
        return {
            "batches": len(self.batches),
            "updates_pending": sum(e.hparams is not None for e in entries),
            "losses_in_flight": sum(e.loss is not None for e in entries),
            "loss_sums": len(self.loss_sums),
            "skipped_pending": len(self.skipped),
        }

    def _close_if_done(self, batch: int) -> None:
        if self.batches[batch].consumed():
            del self.batches[batch]


@dataclass
class LossBroadcast:
    """LOSS(b), the executor's handler: the last stage broadcasts batch b's mean loss to its pipeline, asynchronously;
    every stage keeps it in the ledger, where the training step takes it (2BW: one step later)."""

    ledger: BatchLedger
    layout: Layout  # the run's: the loss is the mean over its microbatches
    is_last: bool
    source: int  # the last stage's global rank
    group: Any  # the pipeline's loss group
    device: torch.device

    def __call__(self, action: Any) -> None:
        if self.is_last:
            value = (self.ledger.take_loss_sum(action.batch) / self.layout.num_microbatches).float()
        else:  # what the last stage sends, whatever the default dtype (float64 under precision="64-true")
            value = torch.zeros((), dtype=torch.float32, device=self.device)
        work = dist.broadcast(value, src=self.source, group=self.group, async_op=True)
        self.ledger.put_loss(action.batch, value, work)
