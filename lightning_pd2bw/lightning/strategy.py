"""The Lightning strategy: a thin adapter from Lightning's hooks to ``PipelineEngine`` (docs/architecture.md). One
Lightning training step is one segment of the schedule; the engine owns ``zero_grad``, ``backward`` and
``optimizer.step``; Lightning counts steps, steps schedulers, logs and checkpoints (``compat``: its private APIs)."""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from typing_extensions import override

from ..engine import layout as rules
from ..engine.comm.grid import ProcessGrid
from ..engine.comm.microbatch import batch_device
from ..engine.engine import PipelineEngine
from ..engine.materialize import parameters_on_meta
from ..engine.observer import Progress
from ..engine.options import DEFAULT_CORRECTION, Clipping, PipelineOptions
from ..engine.state.ledger import BatchLedger
from . import auto_plan, checks
from .checkpoints import StageCheckpoints
from .compat import (
    before_optimizer_step_hooks,
    optimizers_to_device,
    place_module,
    several_optimizers_allowed,
    skip_lightning_backward,
)
from .contract import pipeline_layers_of
from .drains import Drains
from .options import STRATEGY_KEYS, StrategyOptions
from .preemption import host_group
from .processes import PipelineProcesses
from .resilience import Resilience


class PipeDream2BWStrategy(PipelineProcesses):
    """Pipeline-parallel training: PipeDream-2BW (``mode="2bw"``), PipeDream-Flush (``"flush"``), ZB-H1 (``"zb_h1"``)
    or interleaved 1F1B (``"interleaved"``). Its keywords are the pipeline's options, documented and checked once in
    ``engine.options.PipelineOptions`` (``strategy.options``; ``clip_mode`` is its ``Clipping``'s mode, the value and
    algorithm the Trainer's), the strategy's own in ``lightning.options.StrategyOptions``
    (``strategy.strategy_options``; the API reference lists both here), and Lightning's ``accelerator``,
    ``parallel_devices``, ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``, ``process_group_backend``
    and ``timeout``, as for ``DDPStrategy``."""

    strategy_name = "pd2bw"

    def __init__(
        self,
        num_stages: int | None = None,
        num_microbatches: int | None = None,
        mode: str = rules.DEFAULT_MODE,
        virtual_stages: int | None = None,
        recompute: bool | list[int] = False,
        clip_mode: str = "global",
        plan: str | None = None,
        global_batch_size: int | None = None,
        layers_per_stage: list[int] | None = None,
        placement: str | None = None,
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
        delay_correction: str | None = DEFAULT_CORRECTION,
        delay_correction_strength: float = 1.0,
        sync_steps: int | None = None,
        boundary_dtype: str | torch.dtype | None = "auto",
        weight_dtype: str | torch.dtype | None = "auto",
        async_checkpoint: bool = False,
        requeue: bool = True,
        init_from: str | None = None,
        lookahead: int = 0,
        compile: bool | dict[str, Any] = False,
        shard_optimizer: bool = True,
        shard_gradients: bool | None = None,
        grad_reduce_dtype: str | torch.dtype | None = None,
        group_creation: str = "split",
    ) -> None:
        lightning_args = (accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin)
        super().__init__(*lightning_args, process_group_backend=process_group_backend, timeout=timeout)
        self.options = PipelineOptions(  # the engine's
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            mode=mode,
            virtual_stages=virtual_stages,
            lookahead=lookahead,
            layers_per_stage=layers_per_stage,
            placement=placement,
            recompute=recompute,
            boundary_dtype=boundary_dtype,
            weight_dtype=weight_dtype,
            compile=compile,
            clipping=Clipping.of(STRATEGY_KEYS, mode=clip_mode),  # the value and algorithm: the Trainer's, at setup
            on_nonfinite=on_nonfinite,
            delay_correction=delay_correction,
            delay_correction_strength=delay_correction_strength,
            sync_steps=sync_steps,
            shard_optimizer=shard_optimizer,
            shard_gradients=shard_gradients,
            grad_reduce_dtype=grad_reduce_dtype,
            group_creation=group_creation,
            keys=STRATEGY_KEYS,
        )
        self.strategy_options = own = StrategyOptions(  # the strategy's own
            plan=plan,
            global_batch_size=global_batch_size,
            failure_timeout=failure_timeout,
            hang_timeout=hang_timeout,
            async_checkpoint=async_checkpoint,
            requeue=requeue,
            keys=STRATEGY_KEYS,
        )
        own.check(self.options)
        checks.check_async_checkpoint(own.async_checkpoint)
        self.checkpoints = StageCheckpoints(own.async_checkpoint, init_from)  # sharded checkpoint I/O; init_from.py
        self.resilience = Resilience(own.failure_timeout, own.hang_timeout, own.requeue)
        self.drains = Drains(self.drain)
        self.planned: Any = None  # the planner's Prediction under plan="auto"
        self.planned_batch: int | None = None  # and each replica's batch size
        self.grid: ProcessGrid | None = None  # built once, after the plan
        self.engine: PipelineEngine | None = None  # this stage's pipeline engine (built in setup)
        self._interrupted = False  # on_exception ran: teardown leaves the engine's groups alone

    # ------------------------------------------------------------------ the layout and the engine's state
    @property
    def stage_layers(self) -> list[range]:
        return self.engine.stage_layers if self.engine is not None else []

    @property
    def progress(self) -> Progress:
        return self.resilience.progress

    @property
    def ledger(self) -> BatchLedger | None:
        """Per batch: global step, hyper-parameters, loss in flight, deferred tied sums (the engine's)."""
        return self.engine.ledger if self.engine is not None else None

    @property
    def skipped_updates(self) -> list[int]:
        return self.engine.skipped_updates if self.engine is not None else []

    # ------------------------------------------------------------------ processes (processes.py)
    @override
    def setup_environment(self) -> None:
        self.set_world_ranks()
        if self.strategy_options.plan is None:  # bad layouts fail before any process group exists
            self._run()
        super().setup_environment()
        self.init_process_group()
        self.checkpoints.create_group()
        checks.check_host_groups([host_group(), self.checkpoints.group])  # bounded: names GLOO_SOCKET_IFNAME
        if self.strategy_options.plan is None:  # under plan="auto" the grid waits for the plan (setup)
            self._build_grid()

    def _build_grid(self) -> None:
        self.grid = ProcessGrid(self.global_rank, self.world_size, self.num_stages, self._run().options.placement)
        self.resilience.start(self.grid)

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._interrupted = True
        self.resilience.on_exception(exception, self.drain, self.checkpoints.wait, self.checkpoints.abandon)

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
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self._interrupted = False
        module = self.lightning_module
        layers = pipeline_layers_of(module)
        checks.check_trainer(trainer, module)
        if self.strategy_options.plan == "auto":
            self._adopt_plan(trainer, layers)
        self.options = checks.check_callbacks(trainer, self._run(), self.options)  # RigL: whole gradients
        assert self.grid is not None
        options = self.options
        fitting = trainer.state.fn == TrainerFn.FITTING
        algorithm = trainer.gradient_clip_algorithm  # the Trainer's clipping, in the engine's options
        algorithm = str(getattr(algorithm, "value", algorithm)) if algorithm else "norm"
        clipping = Clipping.of(STRATEGY_KEYS, trainer.gradient_clip_val, algorithm, options.clipping.mode)
        self.options, self.run = options.replace(clipping=clipping), None
        self.engine = PipelineEngine(
            layers,
            self._run(),
            module.pipeline_inputs,
            module.pipeline_loss,
            device=self.root_device,
            grid=self.grid,
            init_layer=getattr(module, "init_pipeline_layer", None),
            root=module,
            before_step=lambda optimizer: before_optimizer_step_hooks(trainer, optimizer),
            progress=self.progress,
            info=rank_zero_info,
        )
        self.checkpoints.bind(self.engine, trainer)
        place_module(module, self.root_device)
        self.model = self.precision_plugin.convert_module(module)
        if fitting:
            with several_optimizers_allowed():  # the engine steps each of them (engine/updates/update.py)
                self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self.engine.start(self.optimizers if fitting else None)
        self.drains.install(trainer, module)  # removed again in teardown
        checks.warn_unused_steps(module)
        rank_zero_info(checks.layout_report(self.engine, options, layers))

    def _adopt_plan(self, trainer: pl.Trainer, layers: list[nn.Module]) -> None:
        """``plan="auto"``: the planner's depth, microbatches, recomputation and cut become this run's options."""
        own = self.strategy_options
        plan = auto_plan.choose(trainer, layers, self.options, own.global_batch_size, self.root_device, self.num_nodes)
        self.options, self.planned, self.planned_batch = plan
        self.strategy_options = dataclasses.replace(own, plan=None, global_batch_size=None)  # planned once
        self.run = None  # resolved again with the plan's layout
        self._build_grid()

    # ------------------------------------------------------------------ checkpoints (checkpoints.py)
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

    def defer_link(self, filepath: Any, linkpath: Any) -> bool:  # save_last="link" to a save in flight (compat.py)
        return self.checkpoints.defer_link(filepath, linkpath)

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """Training loaders get a resumable sampler (the exact data position on resume, ``data_position.py``);
        under ``plan="auto"`` each replica reads global_batch_size / width samples per step."""
        from torch.utils.data import DataLoader

        from .data_position import prepare_train_loader

        trainer = self.lightning_module.trainer
        if not isinstance(dataloader, DataLoader) or not trainer.training:
            return dataloader
        position, self.checkpoints.resume_data = self.checkpoints.resume_data, None
        return prepare_train_loader(dataloader, trainer, self.num_microbatches, self.planned_batch, position)

    # ------------------------------------------------------------------ training
    @override
    def on_train_start(self) -> None:
        trainer = self.lightning_module.trainer
        skip_lightning_backward(trainer)  # the engine owns zero_grad and backward
        self.resilience.on_train_start(trainer, self.engine, self.checkpoints.failed, self.checkpoints.wait)
        rank_zero_info(f"pd2bw: {checks.start_line(trainer, self.engine, self.options)}")
        checks.expect_scheduler_before_first_update()

    @override
    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        return closure()  # the pipeline applies updates at its STEP actions

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """A middle stage's batch stays on the host (``batch_device``); the LightningModule's transfer hooks
        still run on every stage, so a hook that reshapes the batch does so alike everywhere."""
        if self.engine is not None:
            device = batch_device(self.engine.grid.stage, self.num_stages, device or self.root_device)
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        assert self.engine is not None
        step, context = self.lightning_module.trainer.global_step, self.precision_plugin.train_step_context()
        loss = self.engine.train_batch(batch, global_step=step, context=context)  # 2BW: the previous batch's loss
        if loss is None:
            return torch.zeros((), device=self.root_device)
        self.lightning_module.log("train_loss", loss, prog_bar=True)
        if self.options.on_nonfinite == "skip":
            self.lightning_module.log("skipped_updates", float(len(self.skipped_updates)))
        return loss

    def drain(self, final: bool = False) -> None:
        """Finish every in-flight microbatch and update; the version rule restarts (``drains.py``: when)."""
        if self.engine is not None:
            self.engine.drain(final)  # final: the run's end, its last stop agreement read

    @override
    def on_validation_start(self) -> None:
        self.drain()  # drains.py, 2

    @override
    def on_train_end(self) -> None:
        self.drain(final=True)  # drains.py, 4
        self.resilience.on_train_end()

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
        for param in self.engine.parameters():
            yield names[id(param)], param

    @override
    def predict_step(self, batch: Any, batch_idx: int = 0, dataloader_idx: int = 0) -> Any:
        """The batch through the pipeline (``PipelineEngine.predict``; the module's ``pipeline_predict`` per
        microbatch on the last stage): every stage returns the batch's predictions, in order."""
        self.progress.tick("predict_step")
        predict_fn, context = getattr(self.lightning_module, "pipeline_predict", None), self.precision_plugin
        return self.engine.predict(batch, predict_fn, context=context.predict_step_context())

    def _evaluate(self, batch: Any, prefix: str) -> None:
        self.progress.tick(f"{prefix}step")
        module, context = self.lightning_module, self.precision_plugin.val_step_context()
        metrics = self.engine.evaluate(batch, getattr(module, "pipeline_metrics", None), context=context)
        module.log_dict({prefix + k: torch.tensor(v, device=self.root_device) for k, v in metrics.items()},
                        prog_bar=True, sync_dist=True)  # fmt: skip

    @override
    def teardown(self) -> None:
        self.checkpoints.close()  # waits for an asynchronous save first
        if self.engine is not None and not self._interrupted:  # after a failure a peer may never reach its barrier
            self.engine.close()  # its process groups and bucket hooks: one engine per fit/validate/test call
        self.resilience.stop()
        self.drains.remove()
        optimizers_to_device(self.optimizers, torch.device("cpu"))
        if self.lightning_module is not None:
            place_module(self.lightning_module, torch.device("cpu"))
        self.precision_plugin.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @override
    def model_to_device(self) -> None:  # setup() places each stage's own layers; other stages' stay on the meta device
        pass

    # ------------------------------------------------------------------ collectives Lightning uses
    def all_reduce_over_stages(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the stages of this pipeline (the processes that together hold one model)."""
        checks.running(self.engine).all_reduce_over_stages(tensor)

    def restart_history(self, parameter: nn.Parameter, positions: torch.Tensor) -> None:
        """Entries of ``parameter`` set from outside the update (a mask change): 2BW's correction forgets them."""
        checks.running(self.engine).restart_history(parameter, positions)

    def replicated_dtype(self) -> torch.dtype | None:
        """The dtype all replicas hold the weights in alike (bf16 where only owners keep float32), or None."""
        return checks.running(self.engine).replicated_dtype

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="PipeDream-2BW pipelines (lightning_pd2bw)")


if PipeDream2BWStrategy.strategy_name not in StrategyRegistry:  # Trainer(strategy="pd2bw") once this module ran
    PipeDream2BWStrategy.register_strategies(StrategyRegistry)
