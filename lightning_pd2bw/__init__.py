"""lightning_pd2bw: PipeDream-2BW pipeline parallelism for PyTorch Lightning.

``import lightning_pd2bw`` registers ``Trainer(strategy="pd2bw")``. Models, data, Hydra and wandb
are imported only where used.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from .strategy import PipeDream2BWStrategy

if PipeDream2BWStrategy.strategy_name not in StrategyRegistry:
    PipeDream2BWStrategy.register_strategies(StrategyRegistry)

__all__ = ["PipeDream2BWStrategy", "checkpoint", "models"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in ("models", "checkpoint", "data", "pipeline", "sparsity"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(name)
