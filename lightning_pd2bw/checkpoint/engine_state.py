"""The engine's checkpoints, for plain PyTorch users: ``PipelineEngine.save(path)`` / ``.load(path)`` write and read
the same sharded format as the Lightning strategy (DCP entries, a manifest, atomic publication: ``store.py``) and
load at any depth x width (resharding), and ``state_dict``/``load_state_dict`` give one rank's state for the same
layout. Model entries and optimizer state are named by the engine's ``root`` (``engine.stage_state_dict``,
``engine.parameter_names``), as the strategy names them, so a stage of another cut finds its own and either side
loads the other's checkpoint. Nothing here imports the engine: it is handed one, through the narrow interface
``Checkpointable`` names."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .store import load_stage, read_meta, same_layout, save_sharded


class Checkpointable(Protocol):
    """What a checkpoint reads of an engine (``PipelineEngine`` is one)."""

    optimizers: list[torch.optim.Optimizer]
    stage_layers: Sequence[range]
    device: torch.device
    info: Callable[[str], None]

    @property
    def stage(self) -> int: ...

    @property
    def skipped_updates(self) -> list[int]: ...

    def drain(self) -> Any: ...

    def barrier(self) -> None: ...

    def manifest_layout(self) -> dict[str, Any]: ...

    def stage_state_dict(self) -> dict[str, torch.Tensor]: ...

    def written_state_dict(self) -> dict[str, torch.Tensor]: ...

    def optimizer_parameter_names(self) -> list[list[list[str]]]: ...

    def restore(self, skipped_updates: list[int]) -> None: ...

    def resume_sync_start(self, recorded: int | None) -> None: ...


def state_dict(engine: Checkpointable) -> dict[str, Any]:
    engine.drain()
    return {
        "layout": {"stage": engine.stage, "stage_layers": [(r.start, r.stop) for r in engine.stage_layers]},
        "layers": engine.stage_state_dict(),
        "optimizers": [optimizer.state_dict() for optimizer in engine.optimizers],
        "skipped_updates": list(engine.skipped_updates),
        "global_step": engine.ledger.fed,  # a restored engine counts on from here (its synchronous start included)
        "sync_steps": engine.manifest_layout().get("sync_steps"),
    }


def load_state_dict(engine: Checkpointable, state: dict[str, Any]) -> None:
    engine.drain()
    cut = [(r.start, r.stop) for r in engine.stage_layers]
    saved = state["layout"]
    if saved["stage"] != engine.stage or [tuple(r) for r in saved["stage_layers"]] != cut:
        raise ValueError(
            f"this state is stage {saved['stage']} of the cut {saved['stage_layers']}; this engine is stage "
            f"{engine.stage} of {cut}: load each rank's own state into the same layout, or use "
            "engine.save(path) / engine.load(path), which reshard"
        )
    own = engine.stage_state_dict()
    if missing := sorted(set(own) - set(state["layers"])):
        raise KeyError(f"this state does not hold this stage's entries {missing[:5]}: it was written for another model")
    with torch.no_grad():
        for name, tensor in own.items():
            tensor.copy_(state["layers"][name])
    _load_optimizers(engine, state["optimizers"])
    engine.restore(state.get("skipped_updates", []))
    engine.ledger.fed = state.get("global_step", engine.ledger.fed)
    engine.resume_sync_start(state.get("sync_steps"))


def save(engine: Checkpointable, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
    """Collective (every rank): drain, then write this stage's layers and optimizer state into ``path``; ``extra``
    (e.g. ``{"step": 100}``) is kept with rank 0's metadata and returned by ``load``."""
    engine.drain()
    path = Path(path)
    checkpoint = {
        "global_step": engine.ledger.fed,  # the steps taken: a resume counts on from here (the synchronous start)
        **(extra or {}),
        "skipped_updates": list(engine.skipped_updates),
        "state_dict": engine.written_state_dict(),  # each weight from the replica keeping its float32 master
        "optimizer_states": [optimizer.state_dict() for optimizer in engine.optimizers],
        "optimizer_param_names": engine.optimizer_parameter_names(),
    }
    layout = engine.manifest_layout()

    def gather(value: Any) -> list[Any]:
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, value)
        return out

    save_sharded(
        path,
        checkpoint,
        layout,
        stage=engine.stage,
        is_global_zero=dist.get_rank() == 0,
        barrier=lambda name: engine.barrier(),
        gather=gather,
    )
    return path


def load(engine: Checkpointable, path: str | Path) -> dict[str, Any]:
    """Read this stage's part of a checkpoint ``save`` wrote at any depth x width (only this stage's bytes); returns
    the ``extra`` given to ``save``. Each rank reads on its own (no collective)."""
    engine.drain()
    meta = read_meta(path)
    manifest = meta.pop("pd2bw")
    num_layers = engine.stage_layers[-1].stop
    if manifest["num_layers"] != num_layers:
        raise ValueError(
            f"checkpoint {str(path)!r} was written for a model with {manifest['num_layers']} pipeline layers; this "
            f"engine has {num_layers}. Build the same model as the checkpoint's run"
        )
    model = engine.stage_state_dict()
    shard = load_stage(
        path,
        stage=engine.stage,
        stage_layers=engine.stage_layers,
        model=model,  # read in place
        names=engine.optimizer_parameter_names(),
        fresh=[optimizer.state_dict() for optimizer in engine.optimizers],
        device=engine.device,
    )
    if "optimizer_states" in shard:
        _load_optimizers(engine, shard["optimizer_states"])
    engine.restore(meta.pop("skipped_updates", []))
    if isinstance(manifest.get("global_step"), int):
        engine.ledger.fed = manifest["global_step"]  # train_batch's default global step goes on from the checkpoint
    engine.resume_sync_start(manifest.get("sync_steps"))
    engine.info(
        f"pd2bw: loaded {path}"
        + ("" if same_layout(manifest, engine.stage_layers) else f" (resharded from {manifest['stage_layers']})")
    )
    return meta


def _load_optimizers(engine: Checkpointable, states: list[dict[str, Any]]) -> None:
    if len(states) != len(engine.optimizers):
        raise ValueError(
            f"this state has {len(states)} optimizer(s); the engine was started with {len(engine.optimizers)}"
        )
    for optimizer, saved in zip(engine.optimizers, states):
        optimizer.load_state_dict(saved)
