"""Preemption: SIGTERM ends every rank at the same step, after a checkpoint, with a "resumable" exit code.

Schedulers preempt with SIGTERM (SLURM, Kubernetes, torchrun's agent forwarding its own), to every rank or
to one. Lightning 2.6's handler runs a blocking ``broadcast`` from inside the signal handler: a rank that is
interrupted in a forward or a weight-version copy then waits in a collective its peers never reach (they
are in a pipeline receive), and the job hangs with live heartbeats. Here:

* the handler only records the signal (and, as Lightning's does, forwards it to the processes its
  launcher started); nothing collective runs inside it;
* at the head of every training step (its program's ``FLAG``, ``engine/schedules/program.py``) each rank issues, asynchronously, a MAX all-reduce of its own
  flag over the world, and reads the previous step's result: every rank learns of a SIGTERM sent to any
  one of them at the same step (one or two steps after it arrived), without a barrier per step. The flag
  is a CPU tensor on a gloo group (the default group when it is gloo, else one made for it): under NCCL a
  device flag would cost a host sync per step (``.item()``) and put a world collective in the GPU's queue
  between the pipeline's messages; on the host it costs a read of a result that arrived a step ago;
* the same all-reduce carries a second flag: this rank's asynchronous checkpoint failed in the background. Every
  rank then raises that failure at the same step (``checkpoint/background.py``), before any rank leaves the
  pipeline, so the run ends with one message rather than a peer's timeout;
* then Lightning's ``received_sigterm`` is set on every rank alike, Lightning raises ``SIGTERMException``
  at the end of that batch, and the strategy drains, writes ``last.ckpt`` into the checkpoint
  callback's directory (when one is configured) and lets the process exit with ``EXIT_CODE`` (75); under SLURM,
  global rank 0 then requeues the job with its own ID (``slurm.py``; ``requeue=False``: not).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..engine.comm.grid import STOP_FLAG_GROUP
from ..observe import watchdog
from . import compat, slurm

_HOST_GROUPS: dict[int, Any] = {}  # id(default group) -> its gloo twin (made once per process group, on every rank)


def host_group() -> Any:
    """A gloo group over the world: collectives on CPU tensors, off the device's queue. Made on every backend (a gloo
    world too), so a CPU run issues the flag where a GPU run does and its trace shows it (``STOP_FLAG_GROUP``). Every
    rank must call it at the same point the first time (it creates a group)."""
    world = dist.group.WORLD
    if id(world) not in _HOST_GROUPS:
        _HOST_GROUPS[id(world)] = dist.new_group(backend="gloo", group_desc=STOP_FLAG_GROUP)
    return _HOST_GROUPS[id(world)]


class Preemption:
    """Records SIGTERM in the handler; agrees on it with every rank at training-step boundaries."""

    def __init__(
        self,
        trainer: Any,
        device: torch.device,
        requeue_job: bool = True,
        save_failed: Callable[[], bool] = lambda: False,
        raise_save_failure: Callable[[], None] = lambda: None,
    ) -> None:
        self.trainer, self.device = trainer, device
        self.save_failed, self.raise_save_failure = save_failed, raise_save_failure  # the background save's
        self.requeue_job = requeue_job  # under SLURM, requeue the job after the checkpoint (slurm.py)
        self.received = False  # this rank got SIGTERM
        self.agreed = False  # every rank knows that some rank got it
        self._pending: tuple[Any, torch.Tensor] | None = None
        self.group: Any = None

    def install(self) -> None:
        """Replace Lightning's SIGTERM handler and its per-step broadcast (call after Lightning registered them;
        on every rank)."""
        self.group = host_group() if dist.is_initialized() else None
        if threading.current_thread() is threading.main_thread():
            previous = compat.sigterm_handler_before_lightning(self.trainer)
            chained = previous if callable(previous) else None

            def on_sigterm(signum: int, frame: Any) -> None:
                first = not self.received
                self.received = True
                launcher = self.trainer.strategy.launcher
                if first and launcher is not None:  # Lightning's launcher started the other ranks: tell them
                    launcher.kill(signum)
                if self.trainer.world_size == 1:
                    self._agree()
                if chained is not None:
                    chained(signum, frame)

            signal.signal(signal.SIGTERM, on_sigterm)
        compat.replace_sigterm_check(self.trainer, lambda: None)  # the engine's program runs ``check`` (FLAG)

    def check(self) -> None:
        """At the start of a training step: read the previous step's agreement, post this step's."""
        stop, failed = self.settle_both()
        if failed:
            self._end_on_save_failure()
        flag = torch.tensor([int(self.received), int(self.save_failed())])  # on the host: no device sync to read it
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True), flag)
        if stop:
            self._agree()

    def _end_on_save_failure(self) -> None:
        """Some rank's background save failed: every rank raises at this step (its own failure, from its future)."""
        import errno

        from ..checkpoint.background import BackgroundSaveFailed

        self.raise_save_failure()
        raise BackgroundSaveFailed(errno.EIO, "another rank's background checkpoint write failed; see rank 0's message")

    def settle(self) -> bool:
        """Wait for the pending agreement; True if some rank had received SIGTERM."""
        return self.settle_both()[0]

    def settle_both(self) -> tuple[bool, bool]:
        """Wait for the pending agreement: (some rank received SIGTERM, some rank's background save failed)."""
        if self._pending is None:
            return False, False
        work, flag = self._pending
        self._pending = None
        work.wait()
        return bool(flag[0]), bool(flag[1])

    def _agree(self) -> None:
        self.agreed = True
        compat.mark_sigterm_received(self.trainer)  # Lightning stops after this batch, on every rank alike

    def stop(
        self, exception: SystemExit, drain: Callable[[], None], wait_for_checkpoint: Callable[[], None], rank: str
    ) -> None:
        """Every rank agreed on a SIGTERM at the same step: drain, write ``last.ckpt`` where the checkpoint
        callback writes, and exit with ``EXIT_CODE`` ("resumable"). ``rank`` names this rank in the message."""
        from lightning.pytorch.callbacks import ModelCheckpoint

        trainer = self.trainer
        self.settle()
        callback = trainer.checkpoint_callback
        path = None
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
            path = Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"
            trainer.save_checkpoint(path)  # drains first (drains.py, 3)
            wait_for_checkpoint()
            if self.requeue_job and trainer.is_global_zero and slurm.under_slurm():
                slurm.say(slurm.requeue())  # the checkpoint is complete: the requeued job resumes from it
        else:
            drain()
        exception.code = watchdog.EXIT_CODE
        where = f"checkpoint written to {path}; resume with ckpt_path=last" if path else "no checkpoint callback"
        print(
            f"pd2bw: preempted (SIGTERM) at global step {trainer.global_step}: {where}. "
            f"{rank} exits with code {watchdog.EXIT_CODE}",
            file=sys.stderr,
            flush=True,
        )
