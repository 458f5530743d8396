"""The pipeline engine: plain PyTorch, no Lightning. Schedules are data; one executor runs them;
``PipelineEngine`` owns a stage's whole step (docs/engine.md)."""

from .engine import PipelineEngine
from .layout import Layout
from .options import Clipping, PipelineOptions

__all__ = ["Clipping", "Layout", "PipelineEngine", "PipelineOptions"]
