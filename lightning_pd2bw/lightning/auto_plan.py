"""``plan="auto"``: profile at start-up and plan (``choose``, which the strategy adopts); each replica's dataloader
is then re-batched to its share of the global batch (``data_position.prepare_train_loader``)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from ..engine.options import PipelineOptions
from .compat import train_dataloader


def choose(
    trainer: pl.Trainer,
    layers: list[nn.Module],
    options: PipelineOptions,
    global_batch: int | None,
    device: torch.device,
    num_nodes: int,
) -> tuple[PipelineOptions, Any, int]:
    """Profile this device and the links, and plan the fastest layout that fits (``plan="auto"``); returns the
    options that run it (the planner's depth, microbatches, recomputation and cut), the planner's best prediction
    and each replica's batch size. Logged to rank 0 and the logger."""
    from ..planner.auto import plan_on_world
    from ..planner.candidate import planning_run
    from ..planner.search import format_table

    loader = train_dataloader(trainer)
    sample = next(iter(loader))
    if global_batch is None:
        global_batch = getattr(loader, "batch_size", None) and loader.batch_size * trainer.world_size
    if not global_batch:
        raise ValueError("plan='auto' needs PipeDream2BWStrategy(global_batch_size=...) for this dataloader")
    module, precision = trainer.lightning_module, trainer.precision_plugin
    best, cluster, ranked = plan_on_world(
        layers,
        sample,
        module.pipeline_inputs,
        module.pipeline_loss,
        device=device,
        num_nodes=num_nodes,
        global_batch=global_batch,
        run=planning_run(options, precision.precision),  # "auto" dtypes: bfloat16 under bf16-mixed
        autocast=precision.train_step_context,
    )
    chosen = best.candidate
    rank_zero_info(
        f"pd2bw plan=auto on {cluster.name}: global batch {global_batch}; chosen width {chosen.width} x "
        f"depth {chosen.depth}, micro_batch_size {chosen.micro_batch_size}, {best.num_microbatches} microbatches, "
        f"recompute={chosen.recompute}; predicted {best.throughput:.2f} samples/s\n{format_table(ranked, limit=5)}"
    )
    if trainer.logger is not None:
        trainer.logger.log_hyperparams(
            {
                "plan": {
                    "num_stages": chosen.depth,
                    "data_parallel_size": chosen.width,
                    "micro_batch_size": chosen.micro_batch_size,
                    "num_microbatches": best.num_microbatches,
                    "recompute": chosen.recompute,
                    "predicted_samples_per_sec": best.throughput,
                    "stage_layers": [[r.start, r.stop] for r in best.stages],
                }
            }
        )
    planned = options.replace(
        num_stages=chosen.depth,
        num_microbatches=best.num_microbatches,
        recompute=chosen.recompute,
        layers_per_stage=tuple(len(r) for r in best.stages),
        shard_gradients=chosen.options.shard_gradients,  # the planner's choice where left to the default (2BW)
        placement=chosen.options.placement,  # where the planner puts the ranks
    )
    return planned, best, global_batch // chosen.width
