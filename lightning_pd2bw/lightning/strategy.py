"""The Lightning strategy: a thin adapter from Lightning's hooks to ``PipelineEngine`` (``engine/engine.py``).

What Lightning sees as one training step ``s`` is one segment of the pipeline schedule (see
``engine/schedule.py``): the forwards of batch ``s``, the backwards interleaved with them and the updates due.
The engine owns ``zero_grad``, ``backward`` and ``optimizer.step`` (``engine/update.py``); Lightning still
counts steps, steps LR schedulers, logs and checkpoints. Checkpoint I/O and resharding are
``lightning/checkpoints.py``; ``plan="auto"`` ``lightning/auto_plan.py``; failure detection ``observe/watchdog.py``; SIGTERM
``lightning/preemption.py``. In 2BW mode a stage finishes batch b's backwards during Lightning step b+1, so at
``on_train_batch_end`` of step s every stage holds weights W(s) (s updates), which batch s+1 uses.

Drains (2BW): before validation, before a checkpoint is written and at the end of fitting the
in-flight backwards and the last update run; afterwards the version rule restarts as at step 0.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import DoublePrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from ..engine import layout as rules
from ..engine.compiled import compile_options
from ..engine.delay_correction import METHODS as delay_correction_methods
from ..engine.engine import PipelineEngine
from ..engine.executor import StageExecutor
from ..engine.grid import ProcessGrid, describe_rank, device_barrier
from ..engine.layout import Layout
from ..engine.ledger import BatchLedger
from ..engine.materialize import parameters_on_meta
from ..engine.microbatch import batch_device, check_last_batch
from ..engine.partition import layer_parameter_counts
from ..engine.update import CLIP_MODES, NONFINITE_POLICIES
from ..observe import watchdog
from . import auto_plan
from .checkpoints import StageCheckpoints
from .compat import (
    SubprocessScriptLauncher,
    all_gather_if_distributed,
    before_optimizer_step_hooks,
    default_backend_for_device,
    init_process_group,
    optimizers_to_device,
    place_module,
    reduce_if_distributed,
    several_optimizers_allowed,
    skip_lightning_backward,
)
from .contract import pipeline_layers_of
from .drains import DrainBeforeTrainEnd
from .preemption import Preemption

STRATEGY_KEYS = rules.Keys(where="PipeDream2BWStrategy: ")  # the layout rules, in the constructor's names


def check_async_checkpoint() -> None:
    """async_checkpoint needs DCP's ``async_save(async_stager=...)`` (torch >= 2.8): refuse older torch by name."""
    import inspect

    import torch.distributed.checkpoint as dcp

    if "async_stager" not in inspect.signature(dcp.async_save).parameters:
        raise ValueError(
            f"PipeDream2BWStrategy(async_checkpoint=True) needs torch >= 2.8 (torch.distributed.checkpoint.async_save "
            f"with async_stager); this is torch {torch.__version__}. Upgrade torch or use async_checkpoint=False"
        )


def _boundary_dtype(value: str | torch.dtype | None) -> str | torch.dtype | None:
    """``"auto"``, None, or a floating-point dtype given as a ``torch.dtype`` or its name (``"bfloat16"``)."""
    if value in (None, "auto"):
        return value
    dtype = getattr(torch, value, None) if isinstance(value, str) else value
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(
            f"PipeDream2BWStrategy(boundary_dtype={value!r}) is invalid; valid: 'auto', None or a floating-point "
            "dtype (torch.bfloat16 or 'bfloat16', 'float16', 'float32')"
        )
    return dtype


class PipeDream2BWStrategy(ParallelStrategy):
    """Pipeline-parallel training: PipeDream-2BW (``mode="2bw"``) or PipeDream-Flush (``mode="flush"``).

    Args:
        num_stages: pipeline depth d (default: the whole world, width 1).
        num_microbatches: microbatches m per batch and replica (default: d); m >= d.
        mode: ``"2bw"`` (double-buffered, no flush), ``"flush"`` (1F1B, drained) or ``"gpipe"``.
        lookahead: forwards in flight beyond 1F1B's on every stage but the last (2bw, flush; at most m - d is
            used): each costs one more stashed microbatch per stage and buys slack between neighbours, whose
            uneven action times 1F1B otherwise turns into waits (0: plain 1F1B, ``d - s`` stashed on stage s).
        recompute: recompute each stage's activations in the backward (stash only stage inputs).
        clip_mode: ``"global"`` clips by the norm over all stages, ``"stage"`` by each stage's own.
        plan: ``"auto"``: at start-up, profile the model on this device, measure the links and choose
            depth, microbatch size and recomputation with the planner (``lightning_pd2bw.planner``);
            ``num_stages`` and ``num_microbatches`` are then chosen, not given.
        layers_per_stage: how many pipeline layers each stage runs (e.g. the planner's cut, balanced by
            time); default: balanced by parameter count.
        on_nonfinite: what a non-finite gradient does: ``"stop"`` (the stage that sees it raises; every rank
            exits, naming it) or ``"skip"`` (all stages agree per batch and skip that update, one scalar
            all-reduce over the pipeline per update; the weights stay as they were, the LR schedule moves on).
        failure_timeout: seconds without a heartbeat after which a rank counts as dead; every other rank
            then exits (code 75) naming it, instead of waiting in a collective (``None``: off).
        hang_timeout: seconds without progress (no action executed by a rank and the ranks it watches) during
            training after which the job counts as stuck: every rank prints where it is and its Python stack,
            and exits (code 75). Must exceed the longest single action or checkpoint write (``None``: off;
            needs ``failure_timeout``).
        delay_correction: ``"error_feedback"`` corrects 2BW's one-step gradient delay, optimizer-agnostic:
            ``W(t+1) = W(t) + D(t) + beta (D(t) - D(t-1))`` with ``D`` the optimizers' updates (see
            ``lightning_pd2bw/engine/delay_correction.py``); one extra buffer of the stage's weights.
            ``None``: the plain 2BW rule. No effect under flush (no delay).
        delay_correction_strength: ``beta`` of the correction (1.0: first-order extrapolation of the update).
        boundary_dtype: the dtype floating-point activations and their gradients cross stage boundaries in.
            ``"auto"``: ``bfloat16`` under ``precision="bf16-mixed"`` (half the bytes on the wire and in the
            receiving stage's stash, as Megatron's ``pipeline_dtype``), else each tensor's own dtype;
            ``None``: always the tensor's own dtype (bitwise the single-device computation); or a dtype
            (``torch.bfloat16`` or its name, ``"bfloat16"``).
        async_checkpoint: save checkpoints asynchronously (``torch.distributed.checkpoint.async_save``): training
            waits only while each rank copies its state to host memory (one copy of the stage's weights and
            optimizer state, pinned on GPUs); the files are written, and the checkpoint published, in the
            background over a gloo group of its own. The next save and the end of training wait for it.
        compile: ``True`` compiles each stage's layers with ``torch.compile`` (per layer, in place: names, hooks and
            checkpoints unchanged); a mapping passes its keys to ``torch.compile`` (``backend``, ``mode``,
            ``fullgraph``, ``dynamic``, ``options``). The run logs ``compile/graphs`` and
            ``compile/recompiles_after_warmup`` (summed over ranks). CUDA-graph modes are refused under 2BW.
        global_batch_size: with ``plan="auto"``, the samples per optimizer step over all replicas
            (default: the dataloader's batch size x world size, as DDP would use); each replica's
            dataloader is re-batched to its share.
    """

    strategy_name = "pd2bw"

    def __init__(
        self,
        num_stages: int | None = None,
        num_microbatches: int | None = None,
        mode: str = rules.DEFAULT_MODE,
        recompute: bool = False,
        clip_mode: str = "global",
        plan: str | None = None,
        global_batch_size: int | None = None,
        layers_per_stage: list[int] | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta = timedelta(minutes=30),
        on_nonfinite: str = "stop",
        failure_timeout: float | None = 180.0,
        hang_timeout: float | None = 600.0,
        delay_correction: str | None = None,
        delay_correction_strength: float = 1.0,
        boundary_dtype: str | torch.dtype | None = "auto",
        async_checkpoint: bool = False,
        lookahead: int = 0,
        compile: bool | dict[str, Any] = False,
    ) -> None:
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin)
        rules.check_mode(mode, STRATEGY_KEYS)
        rules.check_lookahead(mode, lookahead, STRATEGY_KEYS)
        if clip_mode not in CLIP_MODES:
            raise ValueError(
                f"PipeDream2BWStrategy(clip_mode={clip_mode!r}) is invalid; valid: {', '.join(CLIP_MODES)}"
            )
        if on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(
                f"PipeDream2BWStrategy(on_nonfinite={on_nonfinite!r}) is invalid; valid: {', '.join(NONFINITE_POLICIES)}"
            )
        if delay_correction not in (None, *delay_correction_methods):
            raise ValueError(
                f"PipeDream2BWStrategy(delay_correction={delay_correction!r}) is invalid; valid: None, "
                f"{', '.join(repr(m) for m in delay_correction_methods)}"
            )
        if delay_correction_strength <= 0:
            raise ValueError(
                f"PipeDream2BWStrategy(delay_correction_strength={delay_correction_strength}) must be > 0 "
                "(1.0: the update extrapolated one step ahead)"
            )
        self.boundary_dtype = _boundary_dtype(boundary_dtype)
        self.compile = compile_options(compile, mode, "PipeDream2BWStrategy(compile=...)")
        if async_checkpoint:
            check_async_checkpoint()
        self.async_checkpoint = async_checkpoint
        self.checkpoints = StageCheckpoints(self, asynchronous=async_checkpoint)  # sharded checkpoint I/O
        self.delay_correction = delay_correction
        self.delay_correction_strength = delay_correction_strength
        self._trainer_with_drain: pl.Trainer | None = None
        self.on_nonfinite = on_nonfinite
        if num_stages is not None:
            rules.check_depth(num_stages, STRATEGY_KEYS)
        if num_stages is not None and num_microbatches is not None:
            rules.check_microbatches(num_stages, num_microbatches, STRATEGY_KEYS)
        if plan not in (None, "auto"):
            raise ValueError(f"PipeDream2BWStrategy(plan={plan!r}) is invalid; valid: None (give num_stages) or 'auto'")
        if plan == "auto" and (num_stages is not None or num_microbatches is not None):
            raise ValueError(
                "PipeDream2BWStrategy(plan='auto') chooses num_stages and num_microbatches itself; leave both unset "
                "(or drop plan='auto' to set them by hand)"
            )
        if global_batch_size is not None and plan != "auto":
            raise ValueError(
                "PipeDream2BWStrategy(global_batch_size=...) is used with plan='auto' only; otherwise the dataloader's "
                "batch size is each replica's batch"
            )
        if layers_per_stage is not None and (plan == "auto" or len(layers_per_stage) != (num_stages or 0)):
            raise ValueError(
                f"PipeDream2BWStrategy(layers_per_stage={list(layers_per_stage)}) needs one entry per stage: give "
                "num_stages=len(layers_per_stage) (and no plan='auto', which cuts the model itself)"
            )
        self.layers_per_stage = list(layers_per_stage) if layers_per_stage is not None else None
        self.plan = plan
        self.global_batch_size = global_batch_size
        self.planned: Any = None  # the planner's Prediction under plan="auto"
        self._requested_stages = num_stages
        self._requested_microbatches = num_microbatches
        self.mode = mode
        self.lookahead = lookahead
        self.recompute = recompute
        self.clip_mode = clip_mode
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        if failure_timeout is not None and failure_timeout <= 0:
            raise ValueError(
                f"PipeDream2BWStrategy(failure_timeout={failure_timeout}) must be > 0 seconds, or None to turn "
                "failure detection off"
            )
        if hang_timeout is not None and hang_timeout <= 0:
            raise ValueError(
                f"PipeDream2BWStrategy(hang_timeout={hang_timeout}) must be > 0 seconds, or None to turn progress "
                "checks off"
            )
        self.failure_timeout = failure_timeout
        self.hang_timeout = hang_timeout
        self.progress = watchdog.Progress()  # ticked by the executor at every action; read by the watchdog
        self._watchdog: watchdog.Watchdog | None = None
        self._num_nodes = 1
        self.grid: ProcessGrid | None = None
        self.engine: PipelineEngine | None = None  # this stage's pipeline engine (built in setup)
        self._interrupted = False  # on_exception ran: teardown leaves the engine's groups alone
        self.stage_layers: list[range] = []
        self._preemption: Preemption | None = None

    # ------------------------------------------------------------------ the engine's state, as users read it
    @property
    def executor(self) -> StageExecutor | None:
        return self.engine.executor if self.engine is not None else None

    @property
    def ledger(self) -> BatchLedger | None:
        """Per batch: global step, hyper-parameters, loss in flight, deferred tied sums (the engine's)."""
        return self.engine.ledger if self.engine is not None else None

    @property
    def skipped_updates(self) -> list[int]:
        return self.engine.skipped_updates if self.engine is not None else []

    # ------------------------------------------------------------------ grid and processes
    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_stages(self) -> int:
        return self._requested_stages or self.world_size

    @property
    def num_microbatches(self) -> int:
        return self._requested_microbatches or self.num_stages

    @property
    def data_parallel_size(self) -> int:
        return rules.width_of(self.world_size, self.num_stages, STRATEGY_KEYS)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # all stages of one pipeline read the same shard: the replica's
        return {"num_replicas": self.data_parallel_size, "rank": self.global_rank // self.num_stages}

    @override
    def _configure_launcher(self) -> None:
        self._validate_precision()
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def _validate_precision(self) -> None:
        plugin = self._precision_plugin
        name = getattr(plugin, "precision", type(plugin).__name__)
        if plugin is not None and type(plugin) not in (Precision, MixedPrecision, DoublePrecision):
            raise ValueError(
                f"precision={name!r} is not supported by strategy='pd2bw' (supported: '32-true', 'bf16-mixed', "
                "'64-true'): in '16-true'/'bf16-true' the weights, both 2BW weight versions and the optimizer state "
                "would be half precision, where updates smaller than the weights' resolution are lost; other plugins "
                "(transformer-engine, bitsandbytes) are untested with the pipeline. Use precision='bf16-mixed' "
                "(bfloat16 compute and stage boundaries, float32 weights)"
            )
        if isinstance(plugin, MixedPrecision) and plugin.precision == "16-mixed":
            raise ValueError(
                "precision='16-mixed' is not supported by strategy='pd2bw': fp16 needs one loss scale shared by "
                "all stages and a skip decision they agree on. Use precision='bf16-mixed' (or '32-true')"
            )

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
        from lightning.pytorch.utilities.rank_zero import rank_zero_only

        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank

    @override
    def setup_environment(self) -> None:
        self.set_world_ranks()
        if self.plan is None:  # bad layouts fail before any process group exists
            rules.check_schedule(self.mode, self.num_stages, self.num_microbatches, STRATEGY_KEYS)
            rules.width_of(self.world_size, self.num_stages, STRATEGY_KEYS)
        super().setup_environment()
        backend = self._process_group_backend or default_backend_for_device(self.root_device)
        self._process_group_backend = backend
        if not dist.is_initialized():
            store = watchdog.attempt_scoped_store(self._timeout)  # torchrun restarts reuse one store
            extra = {"store": store} if store is not None else {}
            if self.root_device.type == "cuda":  # NCCL binds its communicators to this device at once
                extra["device_id"] = self.root_device
            if backend == "nccl":
                watchdog.enable_flight_recorder(os.environ.get("PD2BW_TRACE_DIR", tempfile.gettempdir()))
            init_process_group(self.cluster_environment, backend, timeout=self._timeout, **extra)
        self.grid = ProcessGrid(self.global_rank, self.world_size, self.num_stages)
        self.checkpoints.create_group()
        self._start_watchdog()

    def _start_watchdog(self) -> None:
        if self.failure_timeout is None:
            return
        grid = self.grid
        replicas = grid.replica_ranks()
        watched = grid.pipeline_ranks() + [replicas[(grid.replica + 1) % len(replicas)]]
        self._watchdog = watchdog.Watchdog(
            watchdog.connect(self.failure_timeout),
            self.global_rank,
            self.world_size,
            watched,
            self._describe_rank,
            self.failure_timeout,
            hang_timeout=self.hang_timeout,
            progress=self.progress,
        )
        self._watchdog.start()

    def _describe_rank(self, rank: int) -> str:
        return describe_rank(rank, self.num_stages)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """A peer's death shows up here as a communication error: wait for the watchdog to name it (it then
        ends this process); an error of this rank's own is published so that every other rank exits."""
        self._interrupted = True
        if isinstance(exception, SIGTERMException) and self._preemption is not None and self._preemption.agreed:
            self._preemption.stop(self, exception)
            if self._watchdog is not None:
                self._watchdog.stop()
                self._watchdog = None
            return
        self.checkpoints.in_flight = None  # an asynchronous save may wait on a dead peer: leave it unpublished
        dog = self._watchdog
        if dog is None:
            return
        if watchdog.is_peer_failure(exception):
            dog.end_on_verdict(dog.timeout + 4 * dog.interval)
        dog.stop(done=False)
        dog.report(f"{type(exception).__name__}: {exception}".strip()[:500])
        dog.linger()  # this process may host the store: the others must read the verdict before it goes
        self._watchdog = None

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` builds the parameters on the meta device (buffers stay real, see
        ``engine/materialize.py``); each stage materialises and initialises only its layers."""
        with parameters_on_meta():
            yield

    # ------------------------------------------------------------------ setup: partition the module
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.grid is not None
        self.accelerator.setup(trainer)
        self._interrupted = False
        module = self.lightning_module
        layers = pipeline_layers_of(module)
        self._check_trainer(trainer)
        DrainBeforeTrainEnd.install(trainer)  # removed again in teardown
        self._trainer_with_drain = trainer
        cut = self._adopt_plan(trainer, layers) if self.plan == "auto" else None
        cut_counts = tuple(len(r) for r in cut) if cut is not None else self.layers_per_stage
        stage_layout = Layout(self.num_stages, self.num_microbatches, self.mode, cut_counts, self.lookahead)
        fitting = trainer.state.fn == TrainerFn.FITTING
        algorithm = trainer.gradient_clip_algorithm
        self.engine = PipelineEngine(
            layers,
            stage_layout,
            module.pipeline_inputs,
            module.pipeline_loss,
            device=self.root_device,
            grid=self.grid,
            init_layer=getattr(module, "init_pipeline_layer", None),
            root=module,
            recompute=self.recompute,
            boundary_dtype=self._resolved_boundary_dtype(),
            clip_val=trainer.gradient_clip_val,
            clip_algorithm=str(getattr(algorithm, "value", algorithm)) if algorithm else "norm",
            clip_mode=self.clip_mode,
            on_nonfinite=self.on_nonfinite,
            delay_correction=self.delay_correction,
            delay_correction_strength=self.delay_correction_strength,
            before_step=lambda optimizer: before_optimizer_step_hooks(trainer, optimizer),
            names=self.checkpoints.parameter_names,
            progress=self.progress,
            info=rank_zero_info,
            compile=self.compile,
        )
        self.stage_layers = self.engine.stage_layers
        place_module(module, self.root_device)
        self.model = self.precision_plugin.convert_module(module)
        if fitting:
            with several_optimizers_allowed():  # the engine steps each of them (engine/update.py)
                self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self.engine.start(self.optimizers if fitting else None)
        self._drain_before_validation_zero_grad(module)
        self._warn_unused_steps(module)
        self._report_layout(layers)

    def _adopt_plan(self, trainer: pl.Trainer, layers: list[nn.Module]) -> list[range]:
        """``plan="auto"``: the planner's depth, microbatches, recomputation and cut become this run's."""
        best, self.global_batch_size = auto_plan.choose(self, trainer, layers)
        self.planned = best
        self._requested_stages = best.candidate.depth
        self._requested_microbatches = best.num_microbatches
        self.recompute = best.candidate.recompute
        self.grid = ProcessGrid(self.global_rank, self.world_size, self.num_stages)
        return list(best.stages)

    # ------------------------------------------------------------------ checkpoints (lightning/checkpoints.py)
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # load into the partitioned, materialised stage

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.checkpoints.module_state_dict()  # drains first: a checkpoint is always taken at a drain

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        self.checkpoints.save(checkpoint, filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        return self.checkpoints.load(checkpoint_path)

    @override
    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        self.checkpoints.load_module_state(checkpoint, strict)

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        self.checkpoints.remove(filepath)

    def wait_for_checkpoint(self) -> None:
        """Block until an asynchronous save is written (and, on global rank 0, published)."""
        self.checkpoints.wait()

    def _check_last_batch(self, dataloader: Any, trainer: pl.Trainer) -> None:
        """A last batch that does not split into microbatches fails before the epoch, when the run reaches it."""
        try:
            samples = len(dataloader.sampler)
        except TypeError:  # an iterable dataset: no length
            return
        size = dataloader.batch_size
        full = samples // size if size else 0
        limit = trainer.limit_train_batches
        reaches_last = (trainer.max_steps == -1 or trainer.max_steps > full) and limit in (None, 1.0)
        if reaches_last or (size and size % self.num_microbatches):
            check_last_batch(samples, size, dataloader.drop_last, self.num_microbatches)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Training loaders get a resumable sampler (exact data position on resume, see ``lightning/data_position.py``);
        under ``plan="auto"`` each replica reads global_batch_size / width samples per step."""
        from torch.utils.data import DataLoader

        from .data_position import make_resumable, resume_at

        trainer = self.lightning_module.trainer
        if not isinstance(dataloader, DataLoader) or not trainer.training:
            return dataloader
        if self.plan == "auto" and self.planned is not None:
            dataloader = auto_plan.rebatch(dataloader, self.global_batch_size, self.data_parallel_size)
        dataloader = make_resumable(dataloader)
        self._check_last_batch(dataloader, trainer)
        position, self.checkpoints.resume_data = self.checkpoints.resume_data, None
        if position is not None:
            resume_at(dataloader, position)
        return dataloader

    def _check_trainer(self, trainer: pl.Trainer) -> None:
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) is not used with strategy='pd2bw': "
                "the pipeline accumulates over its microbatches. Set PipeDream2BWStrategy(num_microbatches=...) and "
                "leave accumulate_grad_batches=1"
            )
        if not self.lightning_module.automatic_optimization:
            raise ValueError("strategy='pd2bw' runs the optimizer itself; set automatic_optimization=True")

    def _report_layout(self, layers: list[nn.Module]) -> None:
        lines = [
            f"pd2bw: mode={self.mode} stages={self.num_stages} data_parallel={self.data_parallel_size} "
            f"microbatches={self.num_microbatches} lookahead={self.lookahead} recompute={self.recompute}"
        ]
        for stage, layer_range in enumerate(self.stage_layers):
            params = sum(layer_parameter_counts([layers[i] for i in layer_range]))
            lines.append(f"  stage {stage}: layers {layer_range.start}..{layer_range.stop - 1} ({params:,} parameters)")
        rank_zero_info("\n".join(lines))

    # ------------------------------------------------------------------ training
    @override
    def on_train_start(self) -> None:
        trainer = self.lightning_module.trainer
        skip_lightning_backward(trainer)  # the engine owns zero_grad and backward
        self._preemption = Preemption(trainer, self.root_device)
        self._preemption.install()
        if self._watchdog is not None:
            self._watchdog.arm()
        # 2BW's first step has no update yet (batch 0's backwards finish in step 1); the scheduler still
        # counts Lightning steps, and each update uses its own batch's learning rate (see engine/update.py)
        warnings.filterwarnings(
            "ignore", message=r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`"
        )

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        return closure()  # the pipeline applies updates at its STEP actions

    def _resolved_boundary_dtype(self) -> torch.dtype | None:
        if self.boundary_dtype != "auto":
            return self.boundary_dtype
        precision = str(getattr(self.precision_plugin, "precision", ""))
        return (
            torch.bfloat16 if isinstance(self.precision_plugin, MixedPrecision) and precision == "bf16-mixed" else None
        )

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """A middle stage's batch stays on the host (``batch_device``); the LightningModule's transfer hooks
        still run on every stage, so a hook that reshapes the batch does so alike everywhere."""
        if self.executor is not None:
            device = batch_device(self.executor.stage, self.executor.num_stages, device or self.root_device)
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        assert self.engine is not None
        loss = self.engine.train_batch(
            batch,
            global_step=self.lightning_module.trainer.global_step,
            context=self.precision_plugin.train_step_context(),
        )  # 2BW: the previous batch's loss (its backwards finish in this step)
        if loss is None:
            return torch.zeros((), device=self.root_device)
        self.lightning_module.log("train_loss", loss, prog_bar=True)
        if self.on_nonfinite == "skip":
            self.lightning_module.log("skipped_updates", float(len(self.skipped_updates)))
        return loss

    # ------------------------------------------------------------------ drains
    def drain(self) -> None:
        """Finish every in-flight microbatch and update; the version rule restarts."""
        if self.engine is not None:
            self.engine.drain()

    @override
    def on_validation_start(self) -> None:
        self.drain()  # a no-op mid-fit (drained before the zero-grad hook, below); trainer.validate() after fit

    def _drain_before_validation_zero_grad(self, module: pl.LightningModule) -> None:
        """Lightning calls ``on_validation_model_zero_grad`` (``module.zero_grad()``) right *before* the mid-fit
        validation loop, i.e. before ``on_validation_start``. Under 2BW the batch in flight has half of its
        gradients accumulated then: zeroing them made the drained update use only the backwards that ran in the
        drain (2BW with validation ended ~1e-2 away from its rule). The drain must come first, so the module's
        hook is wrapped on this instance: drain (with gradients on: not inside the val loop's no-grad), then the
        module's own hook."""
        hook = module.on_validation_model_zero_grad

        def drain_then_zero_grad() -> None:
            with torch.enable_grad():
                self.drain()
            hook()

        module.on_validation_model_zero_grad = drain_then_zero_grad

    @override
    def on_train_end(self) -> None:
        self.drain()
        if self._preemption is not None:
            self._preemption.settle()
        if self._watchdog is not None:
            self._watchdog.disarm()

    # ------------------------------------------------------------------ evaluation
    @override
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "val_")

    @override
    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._evaluate(batch, "test_")

    def stage_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This stage's own parameters by name (what a callback may read or change; other stages' layers hold
        meta tensors here). Under 2BW between steps they are the newest weights."""
        names = {id(p): n for n, p in self.lightning_module.named_parameters(remove_duplicate=False)}
        for param in self.engine.params:
            yield names[id(param)], param

    def _warn_unused_steps(self, module: pl.LightningModule) -> None:
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

    @override
    def predict_step(self, batch: Any, batch_idx: int = 0, dataloader_idx: int = 0) -> Any:
        """The batch through the pipeline (forward only, newest weights); the last stage applies the module's
        ``pipeline_predict(output, batch)`` to each microbatch (default: the output itself) and every stage of the
        pipeline returns the batch's predictions, concatenated along dimension 0, in order."""
        self.progress.tick("predict_step")
        predict_fn = getattr(self.lightning_module, "pipeline_predict", None)
        return self.engine.predict(batch, predict_fn, context=self.precision_plugin.predict_step_context())

    def _evaluate(self, batch: Any, prefix: str) -> None:
        self.progress.tick(f"{prefix}step")
        module = self.lightning_module
        metrics_fn = getattr(module, "pipeline_metrics", None)
        metrics = self.engine.evaluate(batch, metrics_fn, context=self.precision_plugin.val_step_context())
        values = {prefix + k: torch.tensor(v, device=self.root_device) for k, v in metrics.items()}
        module.log_dict(values, prog_bar=True, sync_dist=True)

    @override
    def teardown(self) -> None:
        self.checkpoints.close()  # waits for an asynchronous save first
        if self.engine is not None and not self._interrupted:  # after a failure a peer may never reach its barrier
            self.engine.close()  # its process groups and bucket hooks: one engine per fit/validate/test call
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self._trainer_with_drain is not None:
            DrainBeforeTrainEnd.remove(self._trainer_with_drain)
            self._trainer_with_drain = None
        if self.lightning_module is not None and "on_validation_model_zero_grad" in vars(self.lightning_module):
            del self.lightning_module.on_validation_model_zero_grad  # the class's hook again
        optimizers_to_device(self.optimizers, torch.device("cpu"))
        if self.lightning_module is not None:
            place_module(self.lightning_module, torch.device("cpu"))
        self.precision_plugin.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @override
    def model_to_device(self) -> None:
        pass  # setup() places each stage's own layers; other stages' layers stay on the meta device

    # ------------------------------------------------------------------ collectives Lightning uses
    def all_reduce_over_stages(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the stages of this pipeline (the processes that together hold one model)."""
        if self.engine is None or self.engine.closed:
            raise RuntimeError(
                "pd2bw: the pipeline's process groups exist only during a trainer call (fit/validate/test/predict); "
                "sum over the stages from a hook that runs inside one (e.g. on_train_end, not on_fit_end)"
            )
        on_device = tensor if tensor.device == self.root_device else tensor.to(self.root_device)  # NCCL: its device
        dist.all_reduce(on_device, group=self.engine.groups.pipeline)
        if on_device is not tensor:
            tensor.copy_(on_device)

    @override
    def barrier(self, name: str | None = None) -> None:
        if dist.is_initialized():
            device_barrier(self.root_device)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        message = [obj]
        dist.broadcast_object_list(message, src=src)
        return message[0]

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return reduce_if_distributed(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return all_gather_if_distributed(tensor, group=group, sync_grads=sync_grads)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="PipeDream-2BW pipeline parallelism (lightning_pd2bw)"
        )
