"""One rank of a job that fails on purpose: ``run_faults.py OUT FAULT RANK STEP [STAGES]``.

Started once per rank with RANK / LOCAL_RANK / WORLD_SIZE / MASTER_* set (as a cluster scheduler
starts them; no agent that would kill the others), so only pd2bw's watchdog stands between a dead
peer and a hang; or once, with PD2BW_TEST_WORLD=N, so that Lightning's own launcher starts the other ranks. Faults, injected on global rank RANK at training step STEP:
  kill          SIGKILL the process at the start of the step
  freeze        SIGSTOP the process (every thread, the watchdog's too, stops; the process stays)
  raise         raise an exception in the step
  raise_logged  the same, each rank with a log file (OUT/rank<R>.log, as pd2bw-train's Hydra keeps one per rank)
  kill_in_save  SIGKILL while writing its shard of the second checkpoint (last.ckpt is overwritten)
  nonfinite     the step's loss becomes NaN on the last stage (on_nonfinite="stop": the stages that see it raise);
                RANK only marks the time
  raise_slow_reader  raise, while every other rank's watchdog reads the verdict 2 s late (a loaded machine):
                the failing rank hosts the store and must not take it away before they have read it
  hang_recv     block forever in a receive from a neighbour that never sends (heartbeats keep beating)
  mismatched    issue a collective no other rank issues (a broadcast of another shape on the world group)
  async_disk_full      async_checkpoint, save_top_k=1 and last.ckpt a link, a save every 3 steps: rank RANK's
                background write of the second checkpoint fails with ENOSPC (the disk filled)
  async_kill_in_write  the same, but rank RANK is SIGKILLed inside the background write of the second checkpoint
  resume        resume the folder's run with ckpt_path="last" (Lightning's own resolution) and train to the end
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch

torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

import lightning_pd2bw.checkpoint.store as ckpt  # noqa: E402
from lightning_pd2bw import PipeDream2BWStrategy  # noqa: E402
from lightning_pd2bw.cli.train import logged, refused  # noqa: E402
from lightning_pd2bw.observe import watchdog  # noqa: E402
from tests.distributed.cases import Case, build_model, dataloader  # noqa: E402
from tests.distributed.harness import quiet_trainer  # noqa: E402
from tests.distributed.launch import mark_fault  # noqa: E402
from tests.distributed.run_cases import PoisonLoss  # noqa: E402

FAILURE_TIMEOUT = 3.0
HANG_TIMEOUT = 4.0  # one step of this model takes ~0.05 s: 4 s without an action is a hang


class Fault(Callback):
    def __init__(self, kind: str, rank: int, step: int) -> None:
        self.kind, self.rank, self.step = kind, rank, step

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        print(f"injecting {self.kind} on rank {self.rank} at step {self.step}", file=sys.stderr, flush=True)
        mark_fault()
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "freeze":
            os.kill(os.getpid(), signal.SIGSTOP)
        if self.kind in ("raise", "raise_slow_reader", "raise_logged"):
            raise RuntimeError("injected fault in training step")
        if self.kind == "hang_recv":
            peer = (self.rank + 1) % trainer.world_size
            torch.distributed.recv(torch.empty(4), src=peer, tag=777)  # nobody sends this
        if self.kind == "mismatched":
            torch.distributed.broadcast(torch.zeros(3), src=self.rank)  # nobody else issues it


def read_verdicts_late() -> None:
    original = watchdog.Watchdog._check

    def check(self):
        if self.store.add(self._key("failed"), 0) > 0:
            time.sleep(2.0)
        return original(self)

    watchdog.Watchdog._check = check


def die_in_second_save(rank: int) -> None:
    """Rank ``rank`` writes part of its file of the second checkpoint, then is killed (SIGKILL)."""
    original, calls = ckpt.write_state, []

    def write_state(folder: Path, entries: dict, *args, **kwargs):
        calls.append(folder)
        if len(calls) == 2 and int(os.environ["RANK"]) == rank:
            (folder / f"__{rank}_0.distcp").write_bytes(b"partial file")
            mark_fault()
            os.kill(os.getpid(), signal.SIGKILL)
        return original(folder, entries, *args, **kwargs)

    ckpt.write_state = write_state


ASYNC_FAULTS = ("async_disk_full", "async_kill_in_write")


def fail_second_background_write(kind: str, rank: int) -> None:
    """Rank ``rank``'s DCP writer fails (ENOSPC) or is killed inside the second checkpoint's background write."""
    import errno

    calls: list[Path] = []

    class Writer(ckpt.ChecksumWriter):
        def write_data(self, plan, planner):
            calls.append(Path(self.path))
            if len(calls) == 2 and int(os.environ["RANK"]) == rank:
                mark_fault()
                if kind == "async_kill_in_write":
                    (Path(self.path) / f"__{rank}_0.distcp").write_bytes(b"partial file")
                    os.kill(os.getpid(), signal.SIGKILL)
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().write_data(plan, planner)

    ckpt.ChecksumWriter = Writer


class SayStart(Callback):
    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        print(f"resumed at step {trainer.global_step}", file=sys.stderr, flush=True)


def main() -> None:
    out, kind, rank, step = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    stages = int(sys.argv[5]) if len(sys.argv) > 5 else int(os.environ["WORLD_SIZE"])
    world = int(os.environ.get("WORLD_SIZE") or os.environ["PD2BW_TEST_WORLD"])  # the latter: Lightning's launcher
    case = Case("fault", mode="2bw", num_stages=stages, num_microbatches=max(stages, 2), steps=8)
    pl.seed_everything(0)
    callbacks: list = [Fault(kind, rank, step)] + ([PoisonLoss(step)] if kind == "nonfinite" else [])
    if kind == "raise_slow_reader" and int(os.environ["RANK"]) != rank:
        read_verdicts_late()
    if kind == "raise_logged":
        import logging

        logging.getLogger().addHandler(logging.FileHandler(out / f"rank{os.environ['RANK']}.log"))
    if kind == "kill_in_save":
        die_in_second_save(rank)
        callbacks.append(ModelCheckpoint(dirpath=out, save_top_k=0, save_last=True, every_n_train_steps=2))
    background = kind in ASYNC_FAULTS or kind == "resume"
    if kind in ASYNC_FAULTS:
        fail_second_background_write(kind, rank)
    if background:
        case = Case("fault", mode="2bw", num_stages=stages, num_microbatches=max(stages, 2), steps=12)
    if kind == "resume":
        callbacks.append(SayStart())
    if background:
        callbacks.append(ModelCheckpoint(dirpath=out, save_top_k=1, save_last="link", every_n_train_steps=3))
    strategy = PipeDream2BWStrategy(
        async_checkpoint=background,
        num_stages=stages,
        num_microbatches=case.num_microbatches,
        timeout=timedelta(seconds=300),  # the process group alone would wait this long
        failure_timeout=FAILURE_TIMEOUT,
        hang_timeout=HANG_TIMEOUT,
    )
    trainer = quiet_trainer(
        strategy,
        devices=world,
        max_steps=case.steps,
        limit_val_batches=0,
        enable_checkpointing=kind == "kill_in_save" or background,
        callbacks=callbacks,
    )
    try:
        trainer.fit(
            build_model(case), train_dataloaders=dataloader(case), ckpt_path="last" if kind == "resume" else None
        )
    except BaseException as error:
        logged(error, "run_faults")  # as pd2bw-train ends: past rank 0, into the rank's log file where it has one
        refused(error, "run_faults")  # a refusal's message alone, last
        raise
    print(f"rank {trainer.global_rank} finished", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
