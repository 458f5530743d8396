"""What the strategy refuses, or warns about, in Lightning's settings (the precision plugin, the trainer's
accumulation and optimization mode, a user's own validation/test step, asynchronous checkpoints on old torch), and
the layout it reports at setup."""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import DoublePrecision, MixedPrecision, Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from ..engine.options import PipelineOptions, Run
from ..engine.partition import layer_parameter_counts
from ..engine.precision import SUPPORTED


def check_precision(plugin: Precision | None) -> None:
    name = getattr(plugin, "precision", type(plugin).__name__)
    if plugin is not None and type(plugin) not in (Precision, MixedPrecision, DoublePrecision):
        raise ValueError(
            f"precision={name!r} is not supported by strategy='pd2bw' (supported: {', '.join(map(repr, SUPPORTED))}): "
            "in '16-true'/'bf16-true' the weights, both 2BW weight versions and the optimizer state "
            "would be half precision, where updates smaller than the weights' resolution are lost; other plugins "
            "(transformer-engine, bitsandbytes) are untested with the pipeline. Use precision='bf16-mixed' "
            "(bfloat16 compute and stage boundaries, float32 weights)"
        )
    if isinstance(plugin, MixedPrecision) and plugin.precision == "16-mixed":
        raise ValueError(
            "precision='16-mixed' is not supported by strategy='pd2bw': fp16 needs one loss scale shared by "
            "all stages and a skip decision they agree on. Use precision='bf16-mixed' (or '32-true')"
        )


def check_trainer(trainer: pl.Trainer, module: pl.LightningModule) -> None:
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(
            f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) is not used with strategy='pd2bw': "
            "the pipeline accumulates over its microbatches. Set PipeDream2BWStrategy(num_microbatches=...) and "
            "leave accumulate_grad_batches=1"
        )
    if not module.automatic_optimization:
        raise ValueError("strategy='pd2bw' runs the optimizer itself; set automatic_optimization=True")


def check_callbacks(trainer: pl.Trainer, run: Run, given: PipelineOptions) -> PipelineOptions:
    """A callback that reads every gradient (``reads_gradients``: RigL's regrowth) needs them whole on each replica;
    sharded gradients leave each replica the gradients of the parameters it owns only. Returns the ``given``
    options: with ``shard_gradients`` left to its default, turned off beside such a callback (said once); set,
    refused."""
    options = run.options
    if not (options.gradients_to_owners and options.shard_optimizer and run.width > 1):
        return given
    for callback in trainer.callbacks:
        if not getattr(callback, "reads_gradients", False):
            continue
        if options.shard_gradients is None:
            rank_zero_info(
                f"pd2bw: {type(callback).__name__} {callback.reads_gradients}: the replicas all-reduce whole "
                "gradients (shard_gradients off; set shard_gradients=False to say so)"
            )
            return given.replace(shard_gradients=False)
        raise ValueError(
            f"{type(callback).__name__} {callback.reads_gradients}, and with "
            f"{options.keys.named('shard_gradients', True)} each replica holds only the gradients of the "
            "parameters it owns: set shard_gradients=False"
        )
    return given


def warn_unused_steps(module: pl.LightningModule) -> None:
    """The pipeline evaluates through ``pipeline_metrics``: a user's own validation/test step is not called."""
    if callable(getattr(module, "pipeline_metrics", None)):
        return
    for hook in ("validation_step", "test_step"):
        owner = next(c for c in type(module).__mro__ if hook in vars(c))
        if owner is not pl.LightningModule:
            rank_zero_warn(
                f"pd2bw: {type(module).__name__}.{hook} is not called under strategy='pd2bw' (the batch runs "
                "through the pipeline; the last stage computes the metrics). It logs the mean of "
                "pipeline_loss as 'val_loss'/'test_loss'; define pipeline_metrics(output, batch) -> dict of "
                "scalar tensors to log your own metrics"
            )


def check_async_checkpoint(enabled: bool) -> None:
    """async_checkpoint needs DCP's ``async_save(async_stager=...)`` (torch >= 2.8): refuse older torch by name."""
    import torch.distributed.checkpoint as dcp

    if enabled and "async_stager" not in inspect.signature(dcp.async_save).parameters:
        raise ValueError(
            f"PipeDream2BWStrategy(async_checkpoint=True) needs torch >= 2.8 (torch.distributed.checkpoint.async_save "
            f"with async_stager); this is torch {torch.__version__}. Upgrade torch or use async_checkpoint=False"
        )


def start_line(trainer: pl.Trainer, engine: Any, options: Any) -> str:
    """At the first training step: 2BW's synchronous start resolved for this run's length (``sync_steps=None``:
    ``sync_start_steps`` of ``trainer.estimated_stepping_batches``, bounded by max_steps, max_epochs or both), and
    the line every entry point prints, ``this run: mode=2bw after a synchronous start of N steps``. A run bounded by
    ``max_time`` alone has no length: refused naming the keys."""
    import math

    from ..engine.sync_start import mode_line

    mode = str(getattr(options.mode, "value", options.mode))
    total = None
    if mode == "2bw" and options.sync_steps is None:
        total = trainer.estimated_stepping_batches  # safe here: the data are set up and any checkpoint is loaded
        if not math.isfinite(total):
            raise ValueError(
                "strategy='pd2bw' (2BW) starts synchronously for 250 steps or half of a shorter run, and this run has "
                "no length (trainer.max_time alone): set trainer.max_steps or trainer.max_epochs, or "
                "PipeDream2BWStrategy(sync_steps=N) (pd2bw-train: strategy.sync_steps=N; 0: no synchronous start)"
            )
    steps = engine.start_synchronously_for(None if total is None else int(total))
    return f"this run: {mode_line(mode, steps if mode == '2bw' else 0)}"


def layout_report(engine: Any, options: Any, layers: list[nn.Module]) -> str:
    """What runs: the mode, depth, width, microbatches and each stage's layers and parameters (rank 0 prints it)."""
    lines = [
        f"pd2bw: mode={options.mode} stages={engine.num_stages} data_parallel={engine.grid.data_parallel_size} "
        f"microbatches={engine.num_microbatches} lookahead={options.lookahead} recompute={options.recompute}"
    ]
    d, chunked = engine.num_stages, len(engine.stage_layers) > engine.num_stages  # interleaved: chunks
    for virtual, layer_range in enumerate(engine.stage_layers):
        params = sum(layer_parameter_counts([layers[i] for i in layer_range]))
        where = f"stage {virtual % d}, chunk {virtual // d}" if chunked else f"stage {virtual}"
        lines.append(f"  {where}: layers {layer_range.start}..{layer_range.stop - 1} ({params:,} parameters)")
    return "\n".join(lines)


def expect_scheduler_before_first_update() -> None:
    """2BW's first step has no update yet (batch 0's backwards finish in step 1); the scheduler still counts
    Lightning's steps, and each update uses its own batch's learning rate (engine/updates/update.py): torch's warning about
    a scheduler stepped before its optimizer does not apply."""
    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`")


GLOO_CHECK_SECONDS = 120


def check_host_groups(groups: list[Any], timeout_s: float = GLOO_CHECK_SECONDS) -> None:
    """At start-up, every gloo group the strategy uses beside training's own (the preemption flag's, the asynchronous
    checkpoints'): a barrier that every rank reaches within ``timeout_s`` or an error naming the ranks that did not
    and the setting that usually explains it (a node whose default interface the others cannot reach)."""
    import datetime

    import torch.distributed as dist

    for group in dict.fromkeys(groups):  # one barrier per distinct group
        if group is None or dist.get_backend(group) != "gloo":
            continue
        try:
            dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
        except RuntimeError as error:
            raise RuntimeError(
                f"pd2bw: a gloo group over every rank (the preemption flag's or the asynchronous checkpoints') did "
                f"not connect within {timeout_s:.0f} s: {error}. On nodes with several network interfaces set "
                "GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME for NCCL) to the one the nodes reach each other on, e.g. "
                "GLOO_SOCKET_IFNAME=ib0 (docs/gpus.md, 'Clusters')"
            ) from error


def running(engine: Any) -> Any:
    """``engine`` while a trainer call runs it; outside one (the pipeline exists only during fit, validate, test or
    predict) a clear error."""
    if engine is None:
        raise RuntimeError(
            "pd2bw: the pipeline exists only during a trainer call (fit/validate/test/predict); "
            "call this from a hook that runs inside one (e.g. on_train_end, not on_fit_end)"
        )
    return engine
