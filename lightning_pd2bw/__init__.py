"""lightning_pd2bw: PipeDream-2BW pipeline parallelism for PyTorch Lightning.

``import lightning_pd2bw`` registers ``Trainer(strategy="pd2bw")``: at once when Lightning is already imported, else
as soon as ``lightning.pytorch`` is (whatever imports it first). The engine underneath
(``lightning_pd2bw.engine.PipelineEngine``) is plain PyTorch: importing it imports neither Lightning nor Hugging Face
(about 4 s of a process's start on a CPU), and it works without Lightning installed. Models, data, Hydra and wandb
are imported only where used.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["Clipping", "Layout", "PipeDream2BWStrategy", "PipelineEngine", "PipelineOptions", "checkpoint", "models"]
__version__ = "0.27.0"


def _register_strategy() -> None:
    """Registers ``"pd2bw"`` in Lightning's registry as a factory that imports the strategy when a Trainer asks for
    it. Registering imports nothing of the adapter: a module of it that imported Lightning first (partly run at this
    moment, e.g. ``lightning/compat.py``) is never re-entered half-done."""
    from lightning.pytorch.strategies import StrategyRegistry

    if "pd2bw" not in StrategyRegistry:
        StrategyRegistry.register("pd2bw", _new_strategy, description="PipeDream-2BW pipelines (lightning_pd2bw)")


def _new_strategy(**init_params: Any) -> Any:
    """``Trainer(strategy="pd2bw")``'s strategy, its module imported now."""
    return importlib.import_module(".lightning.strategy", __name__).PipeDream2BWStrategy(**init_params)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback`` once, right after module ``name`` is first imported (its loader finished executing it)."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # one shot; the finders after it find the module
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            execute, callback = spec.loader.exec_module, self.callback

            def exec_module(module: Any) -> None:
                execute(module)
                callback()

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]  (this module's loader only)
        return spec


def _lightning_installed() -> bool:
    try:
        return importlib.util.find_spec("lightning") is not None
    except (ImportError, ValueError):  # an import hook that refuses it: as good as absent
        return False


if "lightning.pytorch" in sys.modules:
    _register_strategy()
elif _lightning_installed():
    sys.meta_path.insert(0, _AfterImport("lightning.pytorch", _register_strategy))


def __getattr__(name: str) -> Any:
    if name in ("models", "checkpoint", "data", "engine", "observe", "planner", "sparsity"):
        return importlib.import_module(f".{name}", __name__)
    if name in ("PipelineEngine", "PipelineOptions", "Clipping", "Layout"):
        return getattr(importlib.import_module(".engine", __name__), name)
    if name == "PipeDream2BWStrategy":
        try:
            return importlib.import_module(".lightning.strategy", __name__).PipeDream2BWStrategy
        except ModuleNotFoundError as missing:
            if not (missing.name or "").startswith("lightning"):
                raise
            raise ImportError(
                "PipeDream2BWStrategy needs Lightning (pip install lightning); without it use "
                "lightning_pd2bw.engine.PipelineEngine in a plain PyTorch loop"
            ) from missing
    raise AttributeError(name)
