"""``torchrun --nproc-per-node 2 run_ddp_sparsity.py OUT``: RigL under Lightning's DDP strategy; every rank
saves its masks and weights so the test can check the replicas agree. ``OUT sharded``: RigL under pd2bw at width 2
with ``shard_gradients=True``, which every rank refuses (each writes the message)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402

from lightning_pd2bw.sparsity import RigL  # noqa: E402
from tests.distributed.cases import Case, build_model, dataloader  # noqa: E402
from tests.distributed.harness import quiet_trainer  # noqa: E402


def refused(out: Path) -> None:
    from lightning_pd2bw import PipeDream2BWStrategy

    strategy = PipeDream2BWStrategy(num_stages=1, mode="flush", shard_gradients=True)
    trainer = quiet_trainer(strategy, devices=2, max_steps=2, callbacks=[RigL(0.5, end_step=6)])
    try:
        trainer.fit(build_model(Case("rigl_sharded")), train_dataloaders=dataloader(Case("rigl_sharded")))
    except ValueError as error:
        (out / f"refused-rank-{trainer.global_rank}.txt").write_text(str(error))


def main() -> None:
    out = Path(sys.argv[1])
    pl.seed_everything(0)
    if sys.argv[2:] == ["sharded"]:
        return refused(out)
    case = Case("ddp_rigl", optimizer="adamw", num_microbatches=2)
    sparsity = RigL(0.5, end_step=6, update_interval=2, drop_fraction=0.5, allocation="erk")
    trainer = quiet_trainer(
        "ddp",
        max_steps=6,
        callbacks=[sparsity],
    )
    model = build_model(case)
    trainer.fit(model, train_dataloaders=dataloader(case))
    state = {"masks": sparsity.sparsifier.masks, "weights": model.state_dict(), "step": sparsity.step}
    torch.save(state, out / f"ddp-rank-{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
