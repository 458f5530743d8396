"""Sharded checkpoints of ``PipeDream2BWStrategy`` (the strategy holds one ``StageCheckpoints`` and maps
Lightning's checkpoint hooks to it): what each rank gives to the save, the manifest's layout and data position, an
asynchronous save in flight, loading at the same or another layout (resharding). The format
(torch.distributed.checkpoint entries) and its atomic publication live in ``checkpoint/store.py`` and
``checkpoint/entries.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from ..checkpoint import store as ckpt
from ..checkpoint.background import Successor
from .compat import combined_train_loader, defer_checkpoint_links
from .data_position import dataset_length


class StageCheckpoints:
    """One stage's checkpoint I/O under Lightning: the engine's state by the module's names, plus what a resumed
    run needs (data position, schedule horizon, callbacks). ``bind(engine, trainer)`` once per trainer call."""

    def __init__(self, asynchronous: bool = False, init_from: str | None = None) -> None:
        self.init_from = init_from  # a fit starts from these weights (init_from.py); a resume's checkpoint wins
        self.engine: Any = None
        self.trainer: Any = None
        self.asynchronous = asynchronous
        self.group: Any = None  # async saves: a gloo group of their own (training uses the default one)
        self.in_flight: Successor | None = None  # an asynchronous save and the removals waiting for it
        self.kept: Path | None = None  # the newest checkpoint this run published (kept until a successor is)
        self.stager: Any = None  # an asynchronous save's host copy, reused by every save
        self.resume_data: dict[str, Any] | None = None  # the data position of the checkpoint being resumed
        defer_checkpoint_links()  # last.ckpt linked to an asynchronous save once it is published

    def bind(self, engine: Any, trainer: Any) -> None:
        """The run's engine; when fitting, every folder a checkpoint callback will save in is checked to be one
        every rank sees, before the first step (``checkpoint.check_shared_folder``)."""
        self.engine, self.trainer = engine, trainer
        if trainer.state.fn == "fit" and self.init_from:
            from .init_from import initialise

            count = initialise(self.init_from, trainer.lightning_module, engine.stage_state_dict())
            rank_zero_info(f"pd2bw: stage 0 starts from the weights of init_from={self.init_from} ({count} tensors)")
        if trainer.state.fn == "fit":
            for callback in trainer.checkpoint_callbacks:
                if getattr(callback, "dirpath", None):
                    ckpt.check_shared_folder(Path(callback.dirpath), trainer.is_global_zero, self._gather_objects)

    @property
    def module(self) -> Any:
        return self.trainer.lightning_module

    def abandon(self) -> None:
        """After a failure: an asynchronous save may wait on a dead peer; leave it unpublished."""
        self.in_flight = None

    def create_group(self) -> None:
        if self.asynchronous and self.group is None:
            self.group = dist.new_group(backend="gloo")

    def module_state_dict(self) -> dict[str, Any]:
        self.engine.drain()  # a checkpoint is always taken at a drain (drains.py, 3)
        return self.engine.written_state_dict()  # the module's names (the engine's root is the module), each weight
        # from the replica keeping its float32 master

    def save(self, checkpoint: dict[str, Any], filepath: Any) -> None:
        self.engine.progress.tick(f"saving checkpoint {filepath}")
        self.wait()  # the previous asynchronous save is published before the next one starts
        if self.engine.optimizers:
            checkpoint["optimizer_param_names"] = self.engine.optimizer_parameter_names()
        pending = ckpt.save_sharded(
            Path(filepath),
            checkpoint,
            self.manifest_layout(),
            stage=self.engine.grid.stage,
            is_global_zero=self.trainer.is_global_zero,
            barrier=lambda name: self.engine.barrier(),
            gather=self._gather_objects,
            process_group=self.group,
            asynchronous=self.asynchronous,
            stager=self._host_stager() if self.asynchronous else None,
        )
        if pending is None:
            self.kept = Path(filepath)
        else:
            self.in_flight = Successor(Path(filepath), pending, self.kept)

    def _host_stager(self) -> Any:
        """One stager per run: its host copy (pinned on GPUs) of the stage's state is reused by every save."""
        if self.stager is None:
            from ..checkpoint.host_stager import HostStager

            self.stager = HostStager()
        return self.stager

    def wait(self) -> None:
        """Block until an asynchronous save is written (and, on global rank 0, published); then the checkpoints it
        supersedes are removed. A failed write raises ``BackgroundSaveFailed`` (the previous checkpoint kept)."""
        pending, self.in_flight = self.in_flight, None
        if pending is not None:
            self.engine.progress.tick("waiting for the asynchronous checkpoint")
            self.kept = pending.settle(self.trainer.is_global_zero)

    def failed(self) -> bool:
        """An asynchronous save in flight has failed (non-blocking; read at every step's agreement)."""
        return self.in_flight is not None and self.in_flight.failed()

    def close(self) -> None:
        self.wait()
        if self.stager is not None:
            self.stager.close()
            self.stager = None

    def _gather_objects(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def manifest_layout(self) -> dict[str, Any]:
        return {
            **self.engine.manifest_layout(),
            "data": self._data_position(),
            "horizon": self._horizon(),
        }

    def _horizon(self) -> dict[str, int | None]:
        """What the run's schedules were computed for: ``trainer.max_steps``, the module's ``*_steps``
        hyper-parameters and the sparsity callbacks' step settings (a resume compares them)."""
        trainer = self.trainer
        out: dict[str, int | None] = {"trainer.max_steps": trainer.max_steps}
        for key, value in self.module.hparams.items():
            if key.endswith("steps") and (value is None or isinstance(value, int)):
                out[f"model.{key}"] = value
        for callback in trainer.callbacks:  # those with a schedule (the sparsity callbacks) say what it was made for
            horizon = getattr(callback, "horizon", None)
            if callable(horizon):
                out.update(horizon())
        return out

    def _data_position(self) -> dict[str, Any] | None:
        """Where the training data stands: samples of this epoch's global order consumed by every replica."""
        trainer = self.trainer
        loader = combined_train_loader(trainer)
        if loader is None or len(loader.flattened) != 1:
            return None
        flat = loader.flattened[0]
        batch_size = getattr(flat, "batch_size", None) or getattr(
            getattr(flat, "batch_sampler", None), "batch_size", None
        )
        if batch_size is None:
            return None
        batches = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        return {
            "epoch": trainer.current_epoch,
            "batches_in_epoch": batches,
            "batch_size_per_replica": batch_size,
            "samples_in_epoch": batches * batch_size * self.engine.grid.data_parallel_size,
            "dataset_samples": dataset_length(getattr(flat, "dataset", None)),  # a resume on other data is refused
        }

    def load(self, checkpoint_path: Any) -> dict[str, Any]:
        meta = ckpt.read_meta(checkpoint_path)
        manifest = meta["pd2bw"]
        # written by PipelineEngine.save (no Lightning): the same entries, read as this Lightning's own checkpoint
        meta.setdefault("pytorch-lightning_version", pl.__version__)
        engine = self.engine
        num_layers = engine.stage_layers[-1].stop
        if manifest["num_layers"] != num_layers:
            raise ValueError(
                f"checkpoint {str(checkpoint_path)!r} was written for a model with {manifest['num_layers']} pipeline "
                f"layers; this model has {num_layers}. Build the same model (model.* settings) as the checkpoint's run"
            )
        self.resume_data = manifest.get("data")
        engine.resume_sync_start(manifest.get("sync_steps"))  # a longer horizon does not re-enter the start
        if changed := horizon_changes(manifest.get("horizon") or {}, self._horizon()):
            rank_zero_warn(
                f"pd2bw: resuming {checkpoint_path} with a different schedule horizon: {changed}. The learning-rate "
                "and sparsity schedules follow the new values from here on, so the steps after the resume differ "
                "from the run this checkpoint came from. To extend a run and keep its schedules, set the old values "
                "explicitly (pd2bw-train: model.max_steps=... and the sparsity.* step keys: sparsity.start_step, "
                "sparsity.end_step, sparsity.update_interval). 2BW's synchronous start keeps the checkpoint's switch "
                f"step ({engine.synchronous_steps}; strategy.sync_steps=N sets another)"
            )
        if not ckpt.same_layout(manifest, engine.stage_layers):
            rank_zero_info(
                f"pd2bw: resharding {checkpoint_path}: written as {manifest['num_stages']} stages x "
                f"{manifest['data_parallel_size']} replicas {manifest['stage_layers']}, loading as {engine.num_stages} x "
                f"{engine.grid.data_parallel_size} {[(r.start, r.stop) for r in engine.stage_layers]}"
            )
        shard = ckpt.load_stage(
            checkpoint_path,
            stage=engine.grid.stage,
            stage_layers=engine.stage_layers,
            model=self.engine.stage_state_dict(),
            names=self.engine.optimizer_parameter_names(),
            fresh=[optimizer.state_dict() for optimizer in engine.optimizers],
            device=engine.device,
        )
        return meta | shard

    def load_module_state(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        module = self.module
        local = self.engine.stage_state_dict()
        missing = sorted(set(local) - set(checkpoint["state_dict"]))
        if strict and missing:
            raise KeyError(
                f"the checkpoint does not hold this stage's entries {missing[:5]}: it was written for another model; "
                "build the same model as the checkpoint's run"
            )
        wrong = [
            f"{k}: checkpoint {tuple(v.shape)}, model {tuple(local[k].shape)}"
            for k, v in checkpoint["state_dict"].items()
            if k in local and tuple(v.shape) != tuple(local[k].shape)
        ]
        if wrong:
            raise ValueError(
                f"the checkpoint's shapes differ from this model's ({'; '.join(wrong[:3])}): it was written for another "
                "model configuration; build the same model (model.* settings) as the checkpoint's run"
            )
        module.load_state_dict(checkpoint["state_dict"], strict=False)

    def defer_link(self, filepath: Any, linkpath: Any) -> bool:
        """``last.ckpt`` is linked to a checkpoint still being written: the link is made once it is published."""
        if self.in_flight is None or Path(filepath) != self.in_flight.path:
            return False
        self.in_flight.links.append((Path(linkpath), Path(filepath)))
        return True

    def remove(self, filepath: Any) -> None:
        """Lightning removes a checkpoint its successor supersedes as soon as the successor's save returns: under an
        asynchronous save, only once the successor is published (``checkpoint/background.py``)."""
        if self.in_flight is not None:
            self.in_flight.removals.append(Path(filepath))
        elif self.trainer.is_global_zero:
            ckpt.remove(Path(filepath))  # a link (``last.ckpt``) alone, never the checkpoint behind it


def horizon_changes(saved: dict[str, Any], current: dict[str, Any]) -> str:
    """``"trainer.max_steps 300 -> 600, model.max_steps 300 -> 600"`` for the keys both record that differ."""
    return ", ".join(f"{k} {saved[k]} -> {current[k]}" for k in saved if k in current and saved[k] != current[k])
