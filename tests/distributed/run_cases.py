"""Train cases over real processes: ``torchrun --nproc-per-node N run_cases.py OUT CASE...``.

Each rank writes the trained weights it keeps at float32 (its stage's, or with the master sharded its share:
``engine.written_state_dict``) to ``OUT/CASE/stage-S-replica-R.pt``; every rank writes its
engine counters (weight versions held, stashed microbatches) to ``OUT/CASE/rank-G.json`` and every
``torch.distributed`` call it made to ``OUT/CASE/calls-rank-G.json`` (replayed under NCCL's semantics
by ``test_nccl_traces.py``).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch

torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

from lightning_pd2bw import PipeDream2BWStrategy  # noqa: E402
from lightning_pd2bw.checkpoint import consolidate  # noqa: E402
from lightning_pd2bw.engine.verify.nccl_model import record_calls  # noqa: E402
from tests.distributed.cases import (  # noqa: E402
    CASES,
    MICRO_BATCH,
    Case,
    build_model,
    dataloader,
    mask_for,
    sparsity_callback,
)
from tests.distributed.harness import quiet_trainer  # noqa: E402
from tests.distributed.slow_cases import SLOW_CASES  # noqa: E402


class FixedMask(Callback):
    """Re-applies fixed masks right after every optimizer step (an optimizer step post-hook)."""

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        masks = {}
        for name, param in module.named_parameters():
            if not param.is_meta and (mask := mask_for(name, param)) is not None:
                masks[name] = (param, mask)

        @torch.no_grad()
        def apply(*_: object) -> None:
            for param, mask in masks.values():
                param.mul_(mask)

        apply()
        for optimizer in trainer.optimizers:
            optimizer.register_step_post_hook(apply)


class Trajectory(Callback):
    """Records, after every training batch, the sparsity callback's step and overall target density."""

    def __init__(self, sparsity) -> None:
        self.sparsity, self.points = sparsity, []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        measured = self.sparsity.sparsifier.measure()  # a collective over the stages, as logging does
        self.points.append([trainer.global_step, self.sparsity.step, measured["overall_target"]])


class PoisonLoss(Callback):
    """The loss of batch ``step`` becomes NaN on the last stage (its forward runs in Lightning step ``step``)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        executor = trainer.strategy.engine.executor
        loss_fn = executor.loss_fn

        def poisoned(output, batch):
            loss = loss_fn(output, batch)
            return loss * float("nan") if trainer.global_step == self.step else loss

        executor.loss_fn = poisoned


def masked_state_nonzero(optimizers: list, sparsity) -> int:
    """Entries of masked weights, and of every optimizer state tensor of a masked weight's shape, that are not 0."""
    count = 0
    for name, mask in sparsity.sparsifier.masks.items():
        param, pruned = sparsity.sparsifier.local[name], ~mask
        count += int(param.detach()[pruned].count_nonzero())
        for optimizer in optimizers:
            for value in optimizer.state.get(param, {}).values():
                if torch.is_tensor(value) and value.shape == param.shape:
                    count += int(value[pruned].count_nonzero())
    return count


def with_sparsity(case: Case, callbacks: list) -> tuple[list, object]:
    sparsity = sparsity_callback(case)
    if sparsity is None:
        return callbacks, None
    return [sparsity, Trajectory(sparsity), *callbacks], sparsity


def save_sparsity(out: Path, prefix: str, rank: int, sparsity, callbacks: list) -> None:
    if sparsity is None:
        return
    torch.save(sparsity.sparsifier.masks, out / f"{prefix}masks-rank-{rank}.pt")
    trajectory = next(c for c in callbacks if isinstance(c, Trajectory)).points
    (out / f"{prefix}trajectory-rank-{rank}.json").write_text(json.dumps(trajectory))


def trainer_for(case: Case, steps: int, callbacks: list, world: int) -> pl.Trainer:
    layout = (
        dict(plan="auto", global_batch_size=MICRO_BATCH * case.num_microbatches)
        if case.plan
        else dict(num_stages=case.num_stages, num_microbatches=case.num_microbatches)
    )
    strategy = PipeDream2BWStrategy(
        **layout,
        mode=case.mode,
        recompute=case.recompute,
        on_nonfinite="skip" if case.poison_step is not None else "stop",
        delay_correction=case.correction,
        async_checkpoint=case.async_checkpoint,
        lookahead=case.lookahead,
        weight_dtype=case.weight_dtype,
        compile={"backend": "aot_eager"} if case.compile else False,
        shard_gradients=case.shard_gradients,
        sync_steps=case.sync_steps,
        placement=case.placement,
        timeout=timedelta(seconds=60),  # a hang fails the test instead of stalling it
    )
    # a run bounded by epochs: max_steps=-1, as Lightning's default (steps = epochs x limit_train_batches)
    bound = dict(max_steps=-1, max_epochs=steps // case.steps_per_epoch) if case.epochs else dict(max_steps=steps)
    return quiet_trainer(
        strategy,
        devices=world,
        **bound,
        precision=case.precision,
        gradient_clip_val=case.clip,
        gradient_clip_algorithm=case.clip_algorithm if case.clip else None,
        limit_val_batches=2 if case.val_every else 0,
        val_check_interval=case.val_every,
        num_sanity_val_steps=0,
        limit_train_batches=case.steps_per_epoch,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        callbacks=callbacks,
    )


def run(case: Case, out: Path, world: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    pl.seed_everything(0)
    model = build_model(case, epochs_bounded=case.epochs is not None)
    callbacks: list = [FixedMask()] if case.mask else []
    if case.poison_step is not None:
        callbacks.append(PoisonLoss(case.poison_step))
    ckpt_dir = out / "checkpoints"
    if case.checkpoint_every:
        callbacks.append(ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=case.checkpoint_every, save_top_k=-1))
    callbacks, sparsity = with_sparsity(case, callbacks)
    trainer = trainer_for(case, case.steps, callbacks, world)
    with record_calls() as recorder:
        trainer.fit(
            model, train_dataloaders=dataloader(case), val_dataloaders=dataloader(case) if case.val_every else None
        )
    recorder.dump(out / f"calls-rank-{trainer.global_rank}.json")
    strategy = trainer.strategy
    executor = strategy.engine.executor
    rank = trainer.global_rank
    where = f"{strategy.grid.stage}-replica-{strategy.grid.replica}"  # each weight from its float32 master's owner
    torch.save(strategy.engine.written_state_dict(), out / f"stage-{where}.pt")
    counters = {
        "skipped": strategy.skipped_updates,
        "stage": strategy.grid.stage,
        "max_versions": executor.versions.max_versions_held,
        "max_stashed": executor.max_stashed,
        "global_step": trainer.global_step,
        "headers_sent": executor.link.headers_sent,
        "headers_received": executor.link.headers_received,
        "peak_pending_sends": executor.link.peak_pending_sends,
        "recomputed_layers": executor.recomputed,  # what counters()["recomputed_layers"] reports
        # what counters()["peak_deferred_weight_grad_bytes"] reports (the engine is closed after fit)
        "peak_deferred_weight_grad_bytes": executor.weight_grads.peak_bytes if executor.weight_grads else 0,
    }
    if sparsity is not None:
        counters["masked_state_nonzero"] = masked_state_nonzero(trainer.optimizers, sparsity)
    if strategy.planned is not None:
        chosen = strategy.planned.candidate
        counters["plan"] = {"width": chosen.width, "depth": chosen.depth, "micro": chosen.micro_batch_size}
    (out / f"rank-{rank}.json").write_text(json.dumps(counters))
    save_sparsity(out, "", rank, sparsity, callbacks)
    if case.checkpoint_every:
        resume(case, out, ckpt_dir, world)


def resume(case: Case, out: Path, ckpt_dir: Path, world: int) -> None:
    """Resume from the first checkpoint and train to the end: must equal the uninterrupted run."""
    first = sorted(ckpt_dir.glob(f"*step={case.checkpoint_every}.ckpt"))[0]
    if torch.distributed.get_rank() == 0:
        torch.save(consolidate(first), out / "consolidated-first.pt")
    pl.seed_everything(0)
    model = build_model(case, epochs_bounded=case.epochs is not None)
    callbacks = [ModelCheckpoint(dirpath=out / "resumed", every_n_train_steps=case.checkpoint_every, save_top_k=-1)]
    callbacks, sparsity = with_sparsity(case, callbacks)
    trainer = trainer_for(replace(case, mode=case.resume_mode or case.mode), case.steps, callbacks, world)
    trainer.fit(model, train_dataloaders=dataloader(case), ckpt_path=first)
    strategy = trainer.strategy
    where = f"{strategy.grid.stage}-replica-{strategy.grid.replica}"
    torch.save(strategy.engine.written_state_dict(), out / f"resumed-stage-{where}.pt")
    save_sparsity(out, "resumed-", trainer.global_rank, sparsity, callbacks)
    if case.epochs:  # resumed for one more epoch: the switch step stays the checkpoint's (no second start)
        pl.seed_everything(0)
        longer = trainer_for(case, case.steps + case.steps // case.epochs, [], world)
        longer.fit(build_model(case, epochs_bounded=True), train_dataloaders=dataloader(case), ckpt_path=first)
        (out / f"longer-rank-{longer.global_rank}.json").write_text(
            json.dumps({"sync_steps": longer.strategy.engine.synchronous_steps})
        )


def main() -> None:
    out = Path(sys.argv[1])
    world = int(__import__("os").environ["WORLD_SIZE"])
    every = {**CASES, **SLOW_CASES}
    for name in sys.argv[2:]:
        if every[name].world != world:
            raise SystemExit(f"case {name} runs on {every[name].world} processes (num_stages x width), not {world}")
        run(every[name], out / name, world)


if __name__ == "__main__":
    main()
