"""Write a checkpoint at one layout, load it at another: ``torchrun ... run_reshard.py save|load OUT:STAGES ...``
(one ``Trainer`` per OUT:STAGES, one after another in the same processes).

save: train the case ``SAVE_STEPS`` steps and checkpoint; every rank writes the optimizer state it holds by
      parameter name (``saved-optim-rank-R.pt``: with replicas, each holds its shard: ``engine/updates/sharding.py``).
load: resume from that checkpoint with ``STAGES`` stages (and the world's width); at the start of
      training (after the restore, before any step) every rank writes what it loaded
      (``loaded-rank-R.pt``: weights, optimizer state by name, sparsity masks), then trains to
      ``case.steps`` and writes its final weights (``final-stage-S-replica-R.pt``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

from tests.distributed.cases import Case, build_model, dataloader  # noqa: E402
from tests.distributed.run_cases import trainer_for, with_sparsity  # noqa: E402

# two optimizers (Muon + AdamW), each with its schedule: every optimizer's state is resharded by name; a fixed
# random mask (a magnitude threshold could flip on Muon's bf16 rounding: see Case.bf16_update)
CASE = Case(
    "reshard", mode="flush", num_microbatches=4, steps=6, schedule=True, sparsity="static_random", optimizer="muon"
)
SAVE_STEPS = 3


def optimizer_by_name(trainer: pl.Trainer) -> dict[str, dict]:
    """``"k:name"`` -> the state of parameter ``name`` in optimizer ``k``."""
    names = trainer.strategy.engine.parameter_names()
    return {
        f"{k}:{names[id(p)][0]}": dict(optimizer.state[p])
        for k, optimizer in enumerate(trainer.optimizers)
        for g in optimizer.param_groups
        for p in g["params"]
    }


class DumpLoaded(Callback):
    def __init__(self, out: Path, sparsity) -> None:
        self.out, self.sparsity = out, sparsity

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        torch.save(
            {
                "weights": {k: v.clone() for k, v in module.state_dict().items() if not v.is_meta},
                "optimizer": optimizer_by_name(trainer),
                "masks": dict(self.sparsity.sparsifier.masks),
                "lr": [[g["lr"] for g in optimizer.param_groups] for optimizer in trainer.optimizers],
            },
            self.out / f"loaded-rank-{trainer.global_rank}.pt",
        )


def run(phase: str, out: Path, stages: int) -> None:
    world = int(os.environ["WORLD_SIZE"])
    out.mkdir(parents=True, exist_ok=True)
    case = Case(**{**CASE.__dict__, "num_stages": stages})
    pl.seed_everything(0)
    if phase == "save":
        callbacks, _ = with_sparsity(case, [ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=SAVE_STEPS)])
        trainer = trainer_for(case, SAVE_STEPS, callbacks, world)
        trainer.fit(build_model(case), train_dataloaders=dataloader(case))
        torch.save(optimizer_by_name(trainer), out / f"saved-optim-rank-{trainer.global_rank}.pt")
        return
    path = next((out / "ckpt").glob(f"*step={SAVE_STEPS}.ckpt"))
    callbacks, sparsity = with_sparsity(case, [])
    trainer = trainer_for(case, case.steps, [*callbacks, DumpLoaded(out, sparsity)], world)
    trainer.fit(build_model(case), train_dataloaders=dataloader(case), ckpt_path=path)
    strategy = trainer.strategy
    where = f"{strategy.grid.stage}-replica-{strategy.grid.replica}"  # each weight from its float32 master's owner
    torch.save(strategy.engine.written_state_dict(), out / f"final-stage-{where}.pt")


def main() -> None:
    phase = sys.argv[1]
    for target in sys.argv[2:]:
        out, stages = target.rsplit(":", 1)
        run(phase, Path(out), int(stages))


if __name__ == "__main__":
    main()
