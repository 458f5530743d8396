"""The Lightning adapter: ``PipeDream2BWStrategy`` maps Lightning's hooks to the engine's calls. Beside it: the
one module that touches Lightning's private APIs (``compat``), the automatic plan, sharded checkpoints' glue,
preemption, drains, the data position on resume, and the callbacks (``RunMetrics``, ``PipelineTrace``)."""

from .strategy import PipeDream2BWStrategy

__all__ = ["PipeDream2BWStrategy"]
