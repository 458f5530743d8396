"""lightning_pd2bw: PipeDream-2BW pipeline parallelism for PyTorch Lightning.

``import lightning_pd2bw`` registers ``Trainer(strategy="pd2bw")``. The engine underneath
(``lightning_pd2bw.engine.PipelineEngine``) is plain PyTorch and works without Lightning installed. Models,
data, Hydra and wandb are imported only where used.
"""

from __future__ import annotations

import importlib
from typing import Any

from .moved import install as _install_moved_modules

_install_moved_modules()  # old module paths (lightning_pd2bw.pipeline, .strategy, ...) import their new places

try:
    from lightning.pytorch.strategies import StrategyRegistry
except ModuleNotFoundError as missing:  # the engine alone (lightning_pd2bw.engine) needs only torch
    _LIGHTNING_MISSING: ModuleNotFoundError | None = missing
else:
    _LIGHTNING_MISSING = None
    from .lightning.strategy import PipeDream2BWStrategy

    if PipeDream2BWStrategy.strategy_name not in StrategyRegistry:
        PipeDream2BWStrategy.register_strategies(StrategyRegistry)

__all__ = ["Layout", "PipeDream2BWStrategy", "PipelineEngine", "checkpoint", "models"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("models", "checkpoint", "data", "engine", "observe", "planner", "sparsity", "pipeline"):
        return importlib.import_module(f".{name}", __name__)
    if name in ("PipelineEngine", "Layout"):
        return getattr(importlib.import_module(".engine", __name__), name)
    if name == "PipeDream2BWStrategy" and _LIGHTNING_MISSING is not None:
        raise ImportError(
            "PipeDream2BWStrategy needs Lightning (pip install lightning); without it use "
            "lightning_pd2bw.engine.PipelineEngine in a plain PyTorch loop"
        ) from _LIGHTNING_MISSING
    raise AttributeError(name)
