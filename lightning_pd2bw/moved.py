"""Old module paths keep importing: ``lightning_pd2bw.pipeline.engine`` is ``lightning_pd2bw.engine.engine``.

The package was cut into layers (``engine/``, ``observe/``, ``checkpoint/``, ``lightning/``, ``cli/``; see the
README's "What moved"). Importing an old path returns the module at its new place (the same module object, so
classes, monkeypatches and ``isinstance`` agree) and warns once with the new name. ``import lightning_pd2bw``
installs the finder.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

_PACKAGE = __name__.rsplit(".", 1)[0]
_OLD_TO_NEW = {  # relative to the package
    "pipeline": "engine",
    "pipeline.activations": "observe.activations",
    "pipeline.build": "engine.build",
    "pipeline.comm": "engine.transport",
    "pipeline.comm_plan": "engine.verify.comm_plan",
    "pipeline.compiled": "engine.compiled",
    "pipeline.delay_correction": "engine.delay_correction",
    "pipeline.draw": "observe.draw",
    "pipeline.engine": "engine.engine",
    "pipeline.executor": "engine.executor",
    "pipeline.gantt": "observe.gantt",
    "pipeline.grad_buckets": "engine.grad_buckets",
    "pipeline.gradients": "engine.gradients",
    "pipeline.grid": "engine.grid",
    "pipeline.layout": "engine.layout",
    "pipeline.ledger": "engine.ledger",
    "pipeline.materialize": "engine.materialize",
    "pipeline.microbatch": "engine.microbatch",
    "pipeline.nccl_model": "engine.verify.nccl_model",
    "pipeline.partition": "engine.partition",
    "pipeline.schedule": "engine.schedule",
    "pipeline.timeline": "observe.timeline",
    "pipeline.torch_compat": "engine.torch_compat",
    "pipeline.update": "engine.update",
    "pipeline.versions": "engine.versions",
    "pipeline.watchdog": "observe.watchdog",
    "strategy": "lightning.strategy",
    "compat": "lightning.compat",
    "auto_plan": "lightning.auto_plan",
    "sharded_checkpoints": "lightning.checkpoints",
    "preemption": "lightning.preemption",
    "drain_callback": "lightning.drains",
    "callbacks": "lightning.callbacks",
    "pipeline_trace": "lightning.trace",
    "contract": "lightning.contract",
    "data.resume": "lightning.data_position",
    "checkpoint_state": "checkpoint.entries",
    "consolidate": "cli.consolidate",
    "config": "cli.config",
    "planner.cli": "cli.plan",
}
MOVED = {f"{_PACKAGE}.{old}": f"{_PACKAGE}.{new}" for old, new in _OLD_TO_NEW.items()}


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:  # already executed at its new place
        pass


class MovedModules(importlib.abc.MetaPathFinder):
    """Finds an old module path and hands back the module at its new one."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(name)
        if new is None:
            return None
        warnings.warn(f"{name} moved to {new}; import it from there", DeprecationWarning, stacklevel=2)
        return importlib.machinery.ModuleSpec(name, _Alias(new), is_package=new.rsplit(".", 1)[-1] in ("engine",))


def install() -> None:
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModules())
