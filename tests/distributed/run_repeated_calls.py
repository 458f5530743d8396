"""One process, several trainer calls: fit, then validate three times with the same Trainer. Each call builds its
own engine; its teardown must release the engine's process groups and gradient-bucket hooks, so that nothing
piles up call after call (``test_teardown.py`` reads what every rank writes to ``OUT/depth-DEPTH``). Each DEPTH
gets its own Trainer, one after another in the same processes.

    torchrun --nproc-per-node=2 tests/distributed/run_repeated_calls.py OUT DEPTH [DEPTH ...]
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_pd2bw import PipeDream2BWStrategy  # noqa: E402
from lightning_pd2bw.data import LMDataset, read_corpus  # noqa: E402
from lightning_pd2bw.engine.updates.grad_buckets import _HOOKS  # noqa: E402
from lightning_pd2bw.models import GPT, GPTConfig  # noqa: E402
from tests.distributed.harness import quiet_trainer  # noqa: E402


def live(group: object) -> bool:
    try:
        dist.get_process_group_ranks(group)
    except Exception:  # destroyed: no longer registered
        return False
    return True


def snapshot(call: str, trainer: pl.Trainer, groups: list, metrics: dict) -> dict:
    gc.collect()  # the previous call's engine is garbage now; its group objects go with it once destroyed
    engine = trainer.strategy.engine
    return {
        "call": call,
        "threads": len(os.listdir("/proc/self/task")),
        "open_files": len(os.listdir("/proc/self/fd")),
        "engine_groups": len(groups),
        "engine_groups_alive": sum(live(g) for g in groups),
        "hooks_left": sum(p in _HOOKS for p in engine.params),
        "val_loss": float(metrics.get("val_loss", float("nan"))),
    }


def calls(out: Path, depth: int) -> None:
    data = LMDataset(read_corpus(max_bytes=100_000), 32)
    pl.seed_everything(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32), lr=1e-3)
    trainer = quiet_trainer(
        # one stage over two processes is data parallelism: flush (2BW there is refused, issue 46)
        PipeDream2BWStrategy(num_stages=depth, num_microbatches=2, mode="2bw" if depth > 1 else "flush"),
        max_steps=2,
        limit_val_batches=2,
    )

    def loader() -> DataLoader:
        return DataLoader(data, batch_size=4, drop_last=True)

    records = []
    groups: list = []

    class KeepGroups(pl.Callback):  # the groups of each call's engine, captured while they are in use
        def setup(self, trainer: pl.Trainer, *args: object, **kwargs: object) -> None:
            groups[:] = []

        def on_train_start(self, trainer: pl.Trainer, *args: object) -> None:
            groups[:] = trainer.strategy.engine.groups.members()

        on_validation_start = on_train_start

    trainer.callbacks.append(KeepGroups())
    trainer.fit(model, train_dataloaders=loader())
    records.append(snapshot("fit", trainer, groups, {}))
    for i in range(3):
        (metrics,) = trainer.validate(model, dataloaders=loader(), verbose=False)
        records.append(snapshot(f"validate {i}", trainer, groups, metrics))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{dist.get_rank()}.json").write_text(json.dumps(records, indent=1))


def main() -> None:
    for depth in sys.argv[2:]:
        calls(Path(sys.argv[1]) / f"depth-{depth}", int(depth))


if __name__ == "__main__":
    main()
