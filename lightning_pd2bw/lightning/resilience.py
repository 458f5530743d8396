"""Failure handling of one rank under the strategy: the watchdog (a dead peer or a hang ends every rank with a
verdict naming it, ``observe/watchdog.py``), SIGTERM agreed at step boundaries (``preemption.py``) and what an
exception does. It takes the grid, the trainer and callables, never the strategy."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

from ..engine.comm.grid import ProcessGrid
from ..engine.observer import Progress
from ..errors import refusal_in
from ..observe import watchdog
from .preemption import Preemption


class Resilience:
    def __init__(self, failure_timeout: float | None, hang_timeout: float | None, requeue: bool = True) -> None:
        self.failure_timeout, self.hang_timeout, self.requeue = failure_timeout, hang_timeout, requeue
        self.progress = Progress()  # ticked by the engine at every action; read by the watchdog
        self.watchdog: watchdog.Watchdog | None = None
        self.preemption: Preemption | None = None
        self.grid: ProcessGrid | None = None

    def start(self, grid: ProcessGrid) -> None:
        """Start the watchdog (``failure_timeout=None``: none): it watches this rank's pipeline and one replica."""
        self.grid = grid
        if self.failure_timeout is None or self.watchdog is not None:
            return
        replicas = grid.replica_ranks()
        watched = grid.pipeline_ranks() + [replicas[(grid.replica + 1) % len(replicas)]]
        self.watchdog = watchdog.Watchdog(
            watchdog.connect(self.failure_timeout),
            grid.rank,
            grid.world_size,
            watched,
            grid.describe,
            self.failure_timeout,
            hang_timeout=self.hang_timeout,
            progress=self.progress,
            log_file=watchdog.log_file(),
        )
        self.watchdog.start()

    def on_train_start(
        self,
        trainer: Any,
        engine: Any,
        save_failed: Callable[[], bool] = lambda: False,
        raise_save_failure: Callable[[], None] = lambda: None,
    ) -> None:
        """Install the stop agreement; the engine's program runs it at each step's head (``engine.stop_flag``),
        where Lightning ran its SIGTERM broadcast: over several processes."""
        self.preemption = Preemption(trainer, engine.device, self.requeue, save_failed, raise_save_failure)
        self.preemption.install()
        if dist.is_initialized() and trainer.world_size > 1:
            engine.stop_flag = self.preemption
        if self.watchdog is not None:
            self.watchdog.arm()

    def on_train_end(self) -> None:
        if self.preemption is not None:
            self.preemption.settle()
        if self.watchdog is not None:
            self.watchdog.disarm()

    def on_exception(
        self,
        exception: BaseException,
        drain: Callable[[], None],
        wait_for_checkpoint: Callable[[], None],
        abandon_checkpoint: Callable[[], None],
    ) -> None:
        """An agreed SIGTERM: drain, checkpoint and exit "resumable". A peer's death shows up as a communication
        error: wait for the watchdog to name it (it then ends this process). An error of this rank's own is
        published so that every other rank exits."""
        preemption = self.preemption
        if isinstance(exception, SIGTERMException) and preemption is not None and preemption.agreed:
            assert self.grid is not None
            rank = self.grid.describe()
            preemption.stop(exception, drain, wait_for_checkpoint, rank)
            self.stop()
            return
        if getattr(exception, "agreed", False):  # raised by every rank at the same step: nobody is left waiting
            self.stop()
            return
        abandon_checkpoint()  # an asynchronous save may wait on a dead peer: leave it unpublished
        dog, self.watchdog = self.watchdog, None
        if dog is None:
            return
        if watchdog.is_peer_failure(exception):
            dog.end_on_verdict(dog.timeout + 4 * dog.interval)
        dog.stop(done=False)
        refusal = refusal_in(exception)
        logged = dog.log_file is not None and dog.rank != 0  # rank 0 says it last; this rank's trace in its log
        if refusal is not None:  # its message is the whole story
            dog.report(str(refusal)[:2000], refused=True)
        else:
            where = f" (its traceback: {dog.log_file})" if logged else ""
            dog.report(f"{type(exception).__name__}: {str(exception).strip()[:500]}{where}")
        if logged:
            exception.pd2bw_log_file = dog.log_file  # type: ignore[attr-defined]  (read by ``cli.train.logged``)
        dog.linger()  # this process may host the store: the others must read the verdict before it goes

    def stop(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
