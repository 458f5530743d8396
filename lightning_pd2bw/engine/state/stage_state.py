"""What a stage's engine is as state: its tensors and optimizers by name, the layout a checkpoint's manifest records,
and the save and load through ``checkpoint/engine_state.py`` (the strategy's format). ``PipelineEngine`` inherits it;
``checkpoint/engine_state.Checkpointable`` is the protocol it meets."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...checkpoint import engine_state
from ..comm.grid import device_barrier

if TYPE_CHECKING:
    from ..comm.grid import ProcessGrid
    from ..layout import Layout
    from .ledger import BatchLedger
    from .versions import WeightVersions


class StageState:
    """The engine's state by name, its manifest layout, save and load (mixed into ``PipelineEngine``)."""

    root: nn.Module
    optimizers: list[torch.optim.Optimizer]
    versions: WeightVersions | None
    ledger: BatchLedger
    grid: ProcessGrid
    layout: Layout
    all_layers: list[nn.Module]
    stage_layers: list[range]
    device: torch.device
    synchronous_steps: int
    options: Any

    def parameter_names(self) -> dict[int, list[str]]:
        """``{id(parameter): [names]}`` of this stage's parameters: their names in ``root`` (a tied one has several),
        the names of messages and checkpoints (``"<layer index>.<name>"`` without a root)."""
        names: dict[int, list[str]] = {}
        for name, param in ((n, p) for n, p in self.root.named_parameters(remove_duplicate=False) if not p.is_meta):
            names.setdefault(id(param), []).append(name)
        return names

    def optimizer_parameter_names(self) -> list[list[list[str]]]:
        """Per optimizer, per parameter in its order: the parameter's names (how checkpoints key optimizer state)."""
        names = self.parameter_names()
        return [[names[id(p)] for g in o.param_groups for p in g["params"]] for o in self.optimizers]

    def stage_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's tensors by their names in ``root`` (other stages' are on the meta device): its checkpoint."""
        return {name: tensor for name, tensor in self.root.state_dict().items() if not tensor.is_meta}

    def written_state_dict(self) -> dict[str, torch.Tensor]:
        """What this rank writes of ``stage_state_dict`` into a sharded checkpoint: where only owners keep a
        parameter's float32 master (``versions.py``), another replica's parameters are left to their owner, so
        the checkpoint holds every weight at float32 (DCP writes each name once, from any rank holding it)."""
        local = self.stage_state_dict()
        if self.versions is None or not self.versions.sharded_master:
            return local
        names = self.parameter_names()
        others = {name for param in self.versions.unmastered() for name in names[id(param)]}
        return {name: tensor for name, tensor in local.items() if name not in others}

    # ------------------------------------------------------------------ state (checkpoint/engine_state.py)
    def manifest_layout(self) -> dict[str, Any]:
        """The run's layout as a checkpoint's manifest records it (``checkpoint/store.py``); taken at a drain: one
        weight version per stage, nothing in flight."""
        versions = self.versions
        return {
            "num_stages": self.layout.num_stages,
            "data_parallel_size": self.grid.data_parallel_size,
            "num_microbatches": self.layout.num_microbatches,
            "mode": self.layout.mode.value,
            "num_layers": len(self.all_layers),
            "stage_layers": [(r.start, r.stop) for r in self.stage_layers],
            "sync_steps": self.synchronous_steps,  # 2BW's switch step: a resume keeps it (``resume_sync_start``)
            "weight_versions": {
                "drained": True,
                "versions_held": versions.num_versions if versions else 1,
                "updates_applied": versions.latest if versions else 0,
            },
        }

    def start_synchronously_for(self, total_steps: int | None) -> int:
        """``sync_steps=None``: the synchronous start of a run of ``total_steps`` (``sync_start.sync_start_steps``), or
        the switch step of the checkpoint resumed (``resume_sync_start``); an explicit ``sync_steps`` stays.
        Returns the switch step."""
        if self.options.sync_steps is None:
            from ..sync_start import sync_start_steps

            recorded = getattr(self, "recorded_start", None)
            self.synchronous_steps = sync_start_steps(total_steps) if recorded is None else recorded
        return self.synchronous_steps

    def resume_sync_start(self, recorded: int | None) -> None:
        """A resume keeps the switch step its checkpoint recorded (a longer horizon does not re-enter the start),
        unless ``sync_steps`` was given explicitly."""
        if recorded is not None and self.options.sync_steps is None:
            self.synchronous_steps = self.recorded_start = int(recorded)

    def restore(self, skipped_updates: list[int]) -> None:
        """After a load: the skipped updates the checkpoint recorded; the version rule restarts."""
        self.ledger.skipped_updates[:] = skipped_updates
        if self.versions is not None:
            self.versions.reset_after_drain()

    def state_dict(self) -> dict[str, Any]:
        """This stage's state after a drain: its tensors (``stage_state_dict``) and its optimizers' states. Save one per rank (``torch.save``); load it into an engine of the same layout and rank."""
        return engine_state.state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned on the same stage of the same layout."""
        engine_state.load_state_dict(self, state)

    def save(self, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """Every rank: drain and write a sharded checkpoint (the strategy's format: DCP entries, a manifest, atomic
        publication) that ``load`` reads at any depth x width; ``extra`` comes back from ``load``."""
        return engine_state.save(self, path, extra)

    def load(self, path: str | Path) -> dict[str, Any]:
        """This stage's part of a checkpoint ``save`` wrote, at this or another layout (resharding)."""
        return engine_state.load(self, path)

    def barrier(self) -> None:
        device_barrier(self.device)
