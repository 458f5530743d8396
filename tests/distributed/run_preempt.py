"""One rank of a job that is preempted: ``run_preempt.py OUT WHO STEP STAGES MAX_STEPS [RESUME [MOMENT]]``.

Started once per rank as a scheduler starts them (RANK / WORLD_SIZE / MASTER_* set, no agent). At
training step STEP, SIGTERM is sent to WHO (``all`` or one global rank) from a helper thread, 20 ms later:
it lands wherever the main thread is (a forward, a receive, a weight-version copy), as a scheduler's does.
A ModelCheckpoint writes into OUT/ckpt (every 100 steps: never, in these runs), so the preempted job leaves
``OUT/ckpt/last.ckpt``. ``RESUME`` = ``last``: resume from it (no signal). ``RESUME`` = ``reference:G``: an
uninterrupted run that writes a checkpoint (and so drains) at global step G, as the preempted run did.
Replica 0's consolidated weights are saved to ``OUT/weights.pt`` at the end.

``MOMENT`` says where the signal lands (``RESUME`` ``-`` for a run that is preempted there):

* ``step`` (the default): 20 ms into training step STEP, no checkpoint before it;
* ``linked``: the same, after periodic checkpoints every 2 steps have made ``last.ckpt`` a link (``save_last: link``);
* ``validation``: in the first validation batch at or after STEP (validation every 2 steps, ``last.ckpt`` a link);
* ``save`` / ``async-save``: inside the first periodic save at or after STEP (synchronous, or ``async_checkpoint``);
* ``drain``: at the start of the drain before the first validation at or after STEP;
* ``batch``: at the start of training step STEP (``PreemptAt`` as a ``pd2bw-train`` callback, test_slurm.py).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch

torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

from lightning_pd2bw import PipeDream2BWStrategy  # noqa: E402
from lightning_pd2bw.checkpoint import consolidate  # noqa: E402
from tests.distributed.cases import Case, build_model, dataloader  # noqa: E402
from tests.distributed.harness import quiet_trainer  # noqa: E402
from tests.distributed.launch import mark_fault  # noqa: E402


def sigterm() -> None:
    """SIGTERM to this process, its wall-clock time on stderr first."""
    mark_fault()
    os.kill(os.getpid(), signal.SIGTERM)


class Preempt(Callback):
    """SIGTERM from a helper thread 20 ms into step ``step``, wherever the main thread is then; where the step takes
    less than 20 ms (a fast CPU), the next step does not start before it is sent, so it lands in step ``step`` or at
    the start of the next, on any machine."""

    def __init__(self, who: str, step: int) -> None:
        self.who, self.step = who, step
        self.sender: threading.Thread | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, *args) -> None:
        if self.sender is not None:
            self.sender.join()  # sent by now: the handler runs at the main thread's next bytecode
            self.sender = None
        if trainer.global_step != self.step or self.who not in ("all", str(trainer.global_rank)):
            return

        def send() -> None:
            time.sleep(0.02)
            sigterm()

        self.sender = threading.Thread(target=send, daemon=True)
        self.sender.start()


class PreemptAt(Callback):
    """SIGTERM sent synchronously at one moment (``MOMENT`` above): the handler runs at the next bytecode, inside it."""

    def __init__(self, who: str, step: int, moment: str) -> None:
        self.who, self.step, self.moment, self.sent = who, step, moment, False

    def _send(self, trainer: pl.Trainer) -> None:
        if not self.sent and trainer.global_step >= self.step and self.who in ("all", str(trainer.global_rank)):
            self.sent = True
            sigterm()

    def on_train_start(self, trainer: pl.Trainer, *args) -> None:
        if self.moment == "drain":
            engine = trainer.strategy.engine
            drain = engine.drain

            def signalled_drain(*args, **kwargs) -> None:
                if not trainer.sanity_checking and trainer.state.stage == "validate":
                    self._send(trainer)
                drain(*args, **kwargs)

            engine.drain = signalled_drain

    def on_train_batch_start(self, trainer: pl.Trainer, *args) -> None:
        if self.moment == "batch":  # at the start of step STEP (pd2bw-train's runs: a Hydra callback node)
            self._send(trainer)

    def on_validation_batch_start(self, trainer: pl.Trainer, *args) -> None:
        if self.moment == "validation" and not trainer.sanity_checking:
            self._send(trainer)

    def on_save_checkpoint(self, trainer: pl.Trainer, *args) -> None:
        if self.moment in ("save", "async-save"):
            self._send(trainer)


class SaveFinal(Callback):
    def on_train_end(self, trainer: pl.Trainer, *args) -> None:
        trainer.save_checkpoint(Path(sys.argv[1]) / "final.ckpt")  # every rank: a sharded checkpoint


class SaveAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(Path(sys.argv[1]) / "reference.ckpt")


def main() -> None:
    out, who, step, stages, max_steps = (
        Path(sys.argv[1]),
        sys.argv[2],
        int(sys.argv[3]),
        int(sys.argv[4]),
        int(sys.argv[5]),
    )
    resume = sys.argv[6] if len(sys.argv) > 6 else ""
    moment = sys.argv[7] if len(sys.argv) > 7 else "step"
    preempted = resume in ("", "-")
    periodic = moment != "step"  # checkpoints every 2 steps, last.ckpt a link to the newest
    validating = moment in ("validation", "drain")
    case = Case("preempt", mode="2bw", num_stages=stages, num_microbatches=max(stages, 2), steps=max_steps)
    pl.seed_everything(0)
    callbacks: list[Callback] = [
        ModelCheckpoint(
            dirpath=out / "ckpt",
            every_n_train_steps=2 if periodic else 100,
            save_top_k=-1 if periodic else 0,
            save_last="link" if periodic else None,
        ),
        SaveFinal(),
    ]
    if preempted and moment in ("step", "linked"):
        callbacks.append(Preempt(who, step))
    elif preempted:
        callbacks.append(PreemptAt(who, step, moment))
    elif resume.startswith("reference:"):
        callbacks.append(SaveAt(int(resume.split(":")[1])))
    trainer = quiet_trainer(
        PipeDream2BWStrategy(
            num_stages=stages,
            num_microbatches=case.num_microbatches,
            timeout=timedelta(seconds=300),
            failure_timeout=5.0,
            hang_timeout=20.0,
            async_checkpoint=moment == "async-save",
        ),
        devices=int(os.environ["WORLD_SIZE"]),
        max_steps=max_steps,
        limit_val_batches=2 if validating else 0,
        val_check_interval=2 if validating else None,
        check_val_every_n_epoch=None if validating else 1,
        enable_checkpointing=True,  # its ModelCheckpoint saves at the SIGTERM and for the reference
        callbacks=callbacks,
    )
    trainer.fit(
        build_model(case),
        train_dataloaders=dataloader(case),
        val_dataloaders=dataloader(case) if validating else None,
        ckpt_path="last" if resume == "last" else None,
    )
    if trainer.global_rank == 0:
        torch.save(consolidate(out / "final.ckpt"), out / "weights.pt")
    print(f"rank {trainer.global_rank} finished at step {trainer.global_step}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
