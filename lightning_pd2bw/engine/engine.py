"""``PipelineEngine``: one stage of a pipeline-parallel training run, in plain PyTorch (no Lightning).

The engine owns the whole step of its stage: it resolves its options into a ``Layout`` once, cuts the model,
materialises and initialises only this stage's layers, builds the process groups, runs each batch's schedule
(``schedule.segment``) with the executor, applies every update (``update.UpdateRule``), drains, evaluates and
predicts. The Lightning strategy is an adapter; a plain PyTorch loop drives it directly (docs/engine.md)::

    dist.init_process_group("gloo")                       # torchrun: every rank runs this script
    layers = model.pipeline_layers()                      # ordered layers (meta or real tensors)
    options = PipelineOptions(num_stages=2, num_microbatches=4)  # mode "2bw"; the other options documented there
    engine = PipelineEngine(layers, options, model.pipeline_inputs, model.pipeline_loss,
                            init_layer=model.init_pipeline_layer)
    engine.start(torch.optim.AdamW(engine.parameters(), lr=3e-4))
    for batch in loader:                                  # each replica reads its own shard
        loss = engine.train_batch(batch)                  # 2BW: the previous batch's loss (None at first)
    engine.drain()                                        # finish the updates in flight

Every rank of one pipeline must feed the same batch (the first stage reads its inputs, the last its labels).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .build import build_stage
from .comm.grid import ProcessGrid, default_device, device_barrier, rank_zero_print
from .comm.microbatch import batch_size_of, split_microbatches, to_device
from .comm.transport import StageLink
from .compiled import CompileMeter, compile_layers
from .counters import stage_counters
from .evaluation import means, on_host
from .executor import StageExecutor
from .interleaving import check_interleaved, chunk_sizes, neighbours
from .layout import Mode
from .observer import ActionRecorder, Progress, SavedTensorMeter, StopFlag
from .options import PipelineOptions, Run
from .schedules import program, schedule
from .state.ledger import BatchLedger, LossBroadcast
from .state.stage_state import StageState
from .state.versions import WeightVersions
from .sync_start import sync_start_steps
from .updates.delay_correction import ErrorFeedback
from .updates.sharding import OptimizerShards
from .updates.stepper import hyperparameters, local_optimizers
from .updates.update import UpdateRule
from .updates.update_build import StageContext, build_update


class PipelineEngine(StageState):
    """One stage of the pipeline (this process's), over the default process group.

    Args:
        layers: the model's ordered pipeline layers (layer ``i``'s output is layer ``i + 1``'s input); layers of
            other stages are released to the meta device here, this stage's are materialised on ``device``.
        options: how the pipeline runs (``PipelineOptions``: depth, microbatches, mode, cut, lookahead, recompute,
            boundary dtype, compile, clipping, non-finite policy, delay correction), resolved once into
            ``engine.layout`` on this world; the width is ``world_size // num_stages``. ``boundary_dtype="auto"``
            is each tensor's own dtype here (the strategy resolves it from Lightning's precision).
        input_fn: ``batch -> inputs`` of the first layer (first stage).
        loss_fn: ``loss_fn(output, batch) -> loss`` of a microbatch (last stage; the update averages it over
            microbatches and replicas).
        device: this stage's device (default: ``cuda:LOCAL_RANK`` where CUDA is available, else the CPU).
        grid: the process grid (default: the layout's over the default group).
        init_layer: ``init_layer(index)`` initialises layer ``index`` when the model was built on the meta device
            (default: each module's ``reset_parameters``).
        root: the module the layers belong to: its names name every tensor in messages and checkpoints (so
            ``engine.save`` and the Lightning strategy write the same entries for the same module), and Hugging Face
            models are initialised through it. Default: ``nn.ModuleList(layers)`` (``"<layer index>.<name>"``).
        before_step: called with each optimizer before its step (after the gradient reductions).
        transport: ``transport(prev_rank, next_rank, device, channels)`` builds the stage's link to its
            neighbours (default ``transport.StageLink``: one process group per pair, sends batched with receives;
            interleaved: the ring's group, a batch a tick); a subclass may record, delay or reroute messages.
        progress: ticked at every action (``observer.Progress``; a watchdog reads it).
        info: rank-0 messages.
    """

    def __init__(
        self,
        layers: Sequence[nn.Module],
        options: PipelineOptions,
        input_fn: Callable[[Any], Any],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        device: torch.device | str | None = None,
        grid: ProcessGrid | None = None,
        init_layer: Callable[[int], None] | None = None,
        root: nn.Module | None = None,
        before_step: Callable[[torch.optim.Optimizer], None] | None = None,
        transport: Callable[..., StageLink] = StageLink,
        progress: Progress | None = None,
        info: Callable[[str], None] = rank_zero_print,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "PipelineEngine needs a process group: call torch.distributed.init_process_group() first "
                "(under torchrun every rank runs the same script)"
            )
        if not isinstance(options, (PipelineOptions, Run)):
            raise TypeError(
                f"PipelineEngine takes PipelineOptions(num_stages=..., num_microbatches=..., mode=...) as its second "
                f"argument, not {type(options).__name__}"
            )
        world_size = grid.world_size if grid is not None else dist.get_world_size()
        run = options.resolve(world_size) if isinstance(options, PipelineOptions) else options  # "auto": own dtypes
        if run.world_size != world_size:
            raise ValueError(f"this Run was resolved on {run.world_size} processes; the process group has {world_size}")
        self.run = run  # resolved once; checked when it was built
        self.options = options = run.options
        self.layout = layout = run.layout
        self.grid = grid or ProcessGrid(dist.get_rank(), world_size, layout.num_stages, options.placement)
        if self.grid.placement != options.placement:
            raise ValueError(f"the grid places ranks by {self.grid.placement!r}; the options say {options.placement!r}")
        self.device = torch.device(device) if device is not None else default_device()
        check_interleaved(options, layout)
        if self.device.type == "cuda":  # object collectives and NCCL's lazy communicators use the current device
            torch.cuda.set_device(self.device)
        self.input_fn, self.loss_fn = input_fn, loss_fn
        self.before_step = before_step
        self.transport = transport
        self.progress = progress or Progress()
        self.info = info
        start = options.sync_steps
        self.synchronous_steps = sync_start_steps(None) if start is None else start  # resolved
        self.stop_flag: StopFlag | None = None  # the strategy's stop agreement at each step's head (program.FLAG)
        self._taken: torch.Tensor | None = None  # the loss the running program's TAKE_LOSS took
        self.ledger = BatchLedger()  # per batch: global step, hyper-parameters, loss in flight, deferred tied sums
        self.executor: StageExecutor | None = None
        self.update: UpdateRule | None = None
        self.versions: WeightVersions | None = None  # this stage's weight versions, from start()
        self.correction: ErrorFeedback | None = None  # 2BW's delay correction, from start()
        self.optimizers: list[torch.optim.Optimizer] = []
        self.all_layers = list(layers)
        split = None if options.group_creation == "split" else False  # None: split where the backend can
        built = build_stage(self.all_layers, layout, self.grid, self.device, init_layer, root, split)
        self.stage_layers, self.layers, self.params = built.stage_layers, built.layers, built.params
        self.groups, self.shared = built.groups, built.shared
        self.root = root if root is not None else nn.ModuleList(self.all_layers)  # what names every tensor
        self.compile_meter = CompileMeter() if options.compile is not None else None
        if options.compile is not None:
            compile_layers(self.layers, options.compile)
        self._closed = False

    # ------------------------------------------------------------------ the stage
    def parameters(self) -> list[nn.Parameter]:
        """This stage's own parameters (a tied one once)."""
        return list(self.params)

    def restart_history(self, parameter: nn.Parameter, positions: torch.Tensor) -> None:
        """Entries set from outside the update (a mask change): the correction forgets them (``ErrorFeedback``)."""
        if self.correction is not None:
            self.correction.restart(parameter, positions)

    @property
    def replicated_dtype(self) -> torch.dtype | None:
        """The dtype every replica of this stage holds all its weights in alike: the versions' where only owners keep
        the float32 master (decisions that must agree over the replicas read the weights in it); None: their own."""
        versions = self.versions
        return versions.compute_dtype if versions is not None and versions.sharded_master else None

    @property
    def device_mesh(self) -> Any:
        """The run's ranks as a ``DeviceMesh`` (``("dp", "pp")``: replicas x stages) over this engine's own replica
        and pipeline groups, for composing a stage with FSDP2 or tensor parallelism (``grid.Groups.mesh``)."""
        grid = self.grid
        return self.groups.mesh(self.device.type, grid.num_stages, grid.data_parallel_size)

    def all_reduce_over_stages(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` in place over the stages of this pipeline (the ranks that together hold one model)."""
        if self._closed:
            raise RuntimeError("pd2bw: this engine was closed (its process groups are gone): sum while it runs")
        on_device = tensor if tensor.device == self.device else tensor.to(self.device)  # NCCL: the group's device
        dist.all_reduce(on_device, group=self.groups.pipeline)
        if on_device is not tensor:
            tensor.copy_(on_device)

    @property
    def mode(self) -> Mode:
        return self.layout.mode

    @property
    def stage(self) -> int:
        """This rank's pipeline stage."""
        return self.grid.stage

    @property
    def num_stages(self) -> int:
        return self.layout.num_stages

    @property
    def num_microbatches(self) -> int:
        return self.layout.num_microbatches

    @property
    def is_first(self) -> bool:
        return self.grid.stage == 0

    @property
    def is_last(self) -> bool:
        return self.grid.stage == self.num_stages - 1

    # ------------------------------------------------------------------ optimizers
    def start(self, optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None) -> None:
        """Attach the optimizers (built over this stage's parameters; other stages' are dropped from their groups)
        and build the executor. Call once, after any dtype conversion of the layers; ``None`` for evaluation only."""
        if isinstance(optimizers, torch.optim.Optimizer):
            optimizers = [optimizers]
        self.optimizers = list(optimizers or [])
        local_optimizers(self.optimizers, self.params, self.parameter_names())  # this stage's
        shards = OptimizerShards.over(self.optimizers, self.grid, self.groups.shard, self.run.shards[0])
        stepped = shards.owned() if shards is not None else self.params
        local_optimizers(self.optimizers, stepped, self.parameter_names())  # with shards: this replica's share
        method = self.options.applied_delay_correction
        if method is not None and self.optimizers:
            self.correction = ErrorFeedback.for_method(method, stepped, self.options.delay_correction_strength)
        link = self.transport(*neighbours(self.layout, self.grid), self.device, self.groups.link)
        owned = None if shards is None else shards.masters_kept(self.params)  # the float32 masters kept here
        self.versions = versions = WeightVersions(
            self.params, self.mode.double_buffered, self.options.weight_dtype, owned=owned
        )
        stage = StageContext(
            self.options, self.params, self.shared, self.groups, self.grid.data_parallel_size, self.device,
            self.ledger, self.parameter_names, lambda: self.grid.describe(), self.info,
        )  # fmt: skip
        self.update = build_update(
            stage, self.optimizers, versions, shards=shards, correction=self.correction, before_step=self.before_step
        )
        last = self.grid.rank_of(self.num_stages - 1)
        loss = LossBroadcast(self.ledger, self.layout, self.is_last, last, self.groups.loss, self.device)
        self.executor = StageExecutor(
            self.layers,
            self.grid.stage,
            self.layout,
            link,
            versions,
            self.input_fn,
            self.loss_fn,
            options=self.options,
            ledger=self.ledger,
            handlers={**self.update.handlers(), schedule.LOSS: loss, **self._step_handlers()},
            gradient_buckets=self.update.store.buckets,
            progress=self.progress,
            parts=self.update.declared,
            chunk_sizes=chunk_sizes(self.layout, self.stage_layers, self.grid.stage),
        )

    def _started(self) -> StageExecutor:
        if self._closed:
            raise RuntimeError("this PipelineEngine was closed (its process groups are gone); build a new one")
        if self.executor is None:
            raise RuntimeError("PipelineEngine.start(optimizers) must be called before training or evaluating")
        return self.executor

    def observe(self, recorder: ActionRecorder | None = None, meter: SavedTensorMeter | None = None) -> None:
        """The observers of this stage from now on (``observer.py``; None: none): an action ``recorder`` (the
        timeline) and a ``meter`` of the activations autograd saves. Call after ``start``."""
        executor = self._started()
        executor.recorder, executor.meter = recorder, meter

    def counters(self) -> dict[str, int]:
        """What this stage holds now, by owner, in bytes (and the peaks since start): the terms the planner's stage
        memory predicts (``planner.cost.stage_memory``), read from the engine itself (``counters.stage_counters``)."""
        assert self.update is not None
        return stage_counters(
            self._started(), self.update, self.correction, self.params, self.optimizers, self.compile_meter
        )

    def _phase(self, name: str) -> AbstractContextManager:
        """Counts the graphs ``torch.compile`` builds during one train batch, drain, evaluation or prediction."""
        return self.compile_meter.phase(name) if self.compile_meter is not None else nullcontext()

    # ------------------------------------------------------------------ training
    def train_batch(
        self, batch: Any, *, global_step: int | None = None, context: AbstractContextManager | None = None
    ) -> torch.Tensor | None:
        """Run one batch's training step (``program.train_step``: its forwards, the backwards and updates due now,
        and how the step ends).

        The update of this batch uses the optimizers' hyper-parameters as they are now (a scheduler stepped after
        this call changes the next batch's). Returns the mean loss, on every stage of the pipeline, of the newest
        batch whose loss is known: under 2BW the previous batch's (``None`` for a run's first batch), under
        flush/gpipe (and 2BW's synchronous start) this batch's. ``global_step`` names the batch in messages (default:
        batches fed so far); ``context`` wraps the compute (e.g. ``torch.autocast``)."""
        executor = self._started()
        global_step = self.ledger.fed if global_step is None else global_step
        self.ledger.fed += 1
        step = self.ledger.open(global_step, [hyperparameters(optimizer) for optimizer in self.optimizers])
        self.progress.tick(f"training step {step} (global step {global_step})")
        executor.feed(step, split_microbatches(batch, self.num_microbatches))
        self.update.attach_gradients()  # e.g. Lightning's module.zero_grad() before validation set them to None
        synchronous = self.mode.double_buffered and global_step < self.synchronous_steps  # drained: fresh weights
        actions, self._taken = self.actions(step, synchronous=synchronous), None
        with context or nullcontext(), self._phase("train"):
            executor.run(actions)  # its TAKE_LOSS sets ``_taken``
        self.versions.rest()  # between batches the stage holds the newest weights (mixed: the master)
        return self._taken

    def actions(self, batch: int, drain: bool = False, synchronous: bool = False) -> list[schedule.Action]:
        """This stage's program for step ``batch`` (``drain``: the drain after it; ``synchronous``: 2BW's start) with
        its update, head and end (``program.py``); ``print(schedule.listing(engine.actions(3)))`` shows it."""
        if drain:
            return program.drain(self.layout, self.grid.stage, batch)
        flag = self.stop_flag is not None
        return program.train_step(self.layout, self.grid.stage, batch, synchronous=synchronous, flag=flag)

    def drain(self, final: bool = False) -> torch.Tensor | None:
        """Finish every microbatch and update in flight (2BW); the version rule restarts. Call before saving,
        evaluating or ending (``final``: the run's end, where the last stop agreement is read). Returns the loss
        ``train_batch`` has not returned yet (2BW: the last batch's)."""
        if self.executor is None:
            return None
        last, self._taken = (self.ledger.next_batch - 1 if self.mode.double_buffered else -1), None
        actions = program.drain(self.layout, self.grid.stage, last, final=final, flag=self.stop_flag is not None)
        with self._phase("drain"):
            self.executor.run(actions)  # its TAKE_LOSS sets ``_taken``
        return self._taken

    def _step_handlers(self) -> dict[schedule.Kind, Callable[[Any], None]]:
        """The handlers of a step's head and end (``actions.STEP_KINDS``; ``program.py`` places them)."""

        def take_loss(op: Any) -> None:
            self._taken = self.ledger.take_loss(op.batch)

        return {
            schedule.FLAG: lambda op: self.stop_flag.check(),
            schedule.LAST_FLAG: lambda op: self.stop_flag.settle(),
            schedule.DRAINED: lambda op: self.executor.finish_drain(),
            schedule.SETTLE: lambda op: self.update.at_drain(),  # e.g. "stop": nothing saved after a non-finite update
            schedule.TAKE_LOSS: take_loss,
            schedule.RESTART: lambda op: self.ledger.restart(),  # batch numbers restart after a drain
        }

    def close(self) -> None:
        """Release what the engine holds beyond itself: its gradient buckets' hooks and its process groups (each
        holds threads, sockets or NCCL communicators, so an engine per ``fit``/``validate`` call would otherwise
        pile them up). Call on every rank, after the last ``drain``, and not after a failure (a dead peer never
        reaches the barrier that comes first); Lightning's strategy does it in ``teardown``. The engine is
        unusable afterwards (its executor's statistics stay readable); a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        if self.update is not None:
            self.update.store.close()
        if dist.is_initialized():
            device_barrier(self.device)  # no rank destroys a group a peer may still use
            self.groups.destroy()

    @property
    def skipped_updates(self) -> list[int]:
        """Global steps whose update ``on_nonfinite="skip"`` dropped."""
        return self.ledger.skipped_updates

    # ------------------------------------------------------------------ evaluation
    def evaluate(
        self,
        batch: Any,
        metrics_fn: Callable[[Any, Any], dict[str, torch.Tensor]] | None = None,
        *,
        context: AbstractContextManager | None = None,
    ) -> dict[str, float]:
        """Forward-only pass on the newest weights (drain first under 2BW); ``metrics_fn(output, microbatch)``
        (default: ``{"loss": loss_fn(...)}``) runs on the last stage. Every stage of the pipeline returns the
        metrics' means over the microbatches."""
        executor = self._started()
        metrics_fn = metrics_fn or (lambda output, micro: {"loss": self.loss_fn(output, micro)})
        with context or nullcontext(), self._phase("evaluate"):
            return executor.evaluate(self._split_for_evaluation(batch), metrics_fn, partial(self._from_last, means))

    def _from_last(self, combine: Callable[[list], Any], results: list) -> Any:
        """EVAL_RESULTS: ``combine`` of the last stage's results, sent to every stage of the pipeline."""
        message = [combine(results) if self.is_last else None]
        dist.broadcast_object_list(message, src=self.grid.rank_of(self.num_stages - 1), group=self.groups.pipeline)
        return message[0]

    def predict(
        self,
        batch: Any,
        predict_fn: Callable[[Any, Any], Any] | None = None,
        *,
        context: AbstractContextManager | None = None,
    ) -> Any:
        """The batch through the pipeline (forward only, newest weights); ``predict_fn(output, microbatch)``
        (default: the output) on the last stage. Every stage returns the batch's predictions, concatenated along
        dimension 0, on its device."""
        executor = self._started()
        predict_fn = predict_fn or (lambda output, _: output)
        with context or nullcontext(), self._phase("predict"):
            joined = executor.evaluate(self._split_for_evaluation(batch), predict_fn, partial(self._from_last, on_host))
        return to_device(joined, self.device)

    def _split_for_evaluation(self, batch: Any) -> list[Any]:
        count = self.num_microbatches if batch_size_of(batch) % self.num_microbatches == 0 else 1
        return split_microbatches(batch, count)
