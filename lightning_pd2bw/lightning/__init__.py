"""The Lightning adapter: ``PipeDream2BWStrategy`` maps Lightning's hooks to the engine's calls. Beside it: the
one module that touches Lightning's private APIs (``compat``), the strategy's own options (``options``: importable
without Lightning, as ``pd2bw-plan`` and the config checks do), the automatic plan, sharded checkpoints' glue,
preemption, drains, the data position on resume, and the callbacks (``RunMetrics``, ``PipelineTrace``)."""

from __future__ import annotations

from typing import Any

__all__ = ["PipeDream2BWStrategy"]


def __getattr__(name: str) -> Any:
    if name == "PipeDream2BWStrategy":  # imports Lightning: only when asked for
        from .strategy import PipeDream2BWStrategy

        return PipeDream2BWStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
