"""One rank of ``init_from`` (issue 65): ``run_init_from.py OUT KIND SOURCE STAGES``.

``KIND`` ``gpt`` (the equality cases' GPT) or ``hf`` (a tiny Hugging Face GPT-2 through ``HFCausalLM``). ``SOURCE``
``-``: train 3 steps at ``STAGES`` stages and write a sharded checkpoint to ``OUT/final.ckpt``. Otherwise: a fit at
``STAGES`` stages with ``init_from=SOURCE``; every rank writes the weights its stage starts from (at
``on_train_start``, before any update) to ``OUT/start-rank-R.pt``, and the optimizer's step count to show it is
fresh.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

from lightning_pd2bw import PipeDream2BWStrategy  # noqa: E402
from tests.distributed import hf_models  # noqa: E402
from tests.distributed.cases import Case, build_model, dataloader  # noqa: E402
from tests.distributed.harness import quiet_trainer  # noqa: E402


class DumpStart(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer: pl.Trainer, *args) -> None:
        state = {k: v.detach().float().cpu() for k, v in trainer.strategy.engine.stage_state_dict().items()}
        torch.save(
            {"state": state, "global_step": trainer.global_step}, self.out / f"start-rank-{trainer.global_rank}.pt"
        )


def main() -> None:
    out, kind, source, stages = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    pl.seed_everything(1 if source != "-" else 0)  # another seed: the started model's own init differs
    if kind == "gpt":
        case = Case("init_from", mode="2bw", num_stages=stages, num_microbatches=2, steps=3)
        model, data = build_model(case), dataloader(case)
    else:
        model = hf_models.build("gpt2")
        rows = hf_models.samples("gpt2")
        data = torch.utils.data.DataLoader(rows, batch_size=4, drop_last=True)
    strategy = PipeDream2BWStrategy(
        num_stages=stages, num_microbatches=2, init_from=None if source == "-" else source, failure_timeout=None
    )
    callbacks = [] if source == "-" else [DumpStart(out)]
    steps = 3 if source == "-" else 1
    trainer = quiet_trainer(strategy, devices=int(os.environ["WORLD_SIZE"]), max_steps=steps, callbacks=callbacks)
    trainer.fit(model, train_dataloaders=data)
    if source == "-":
        trainer.save_checkpoint(out / "final.ckpt")


if __name__ == "__main__":
    main()
