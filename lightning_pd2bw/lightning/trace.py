"""``PipelineTrace``: a Lightning callback that records the pd2bw pipeline's timeline.

It switches the executor's recorder on at the start of fitting, logs each stage's bubble fraction
(``bubble/stage{s}``, mean over replicas) every ``log_every_n_steps``, and at the end writes the
steps it kept, merged over all ranks, as a Chrome/Perfetto trace (``trace.json``) and a Gantt chart
(``timeline.png``, with matplotlib installed). Validation, and the drain before it, is left out of
the bubble windows.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from ..observe.timeline import Recorder, StageTimeline, busy_seconds, write_chrome_trace


class PipelineTrace(Callback):
    """Timeline of ``strategy="pd2bw"``: bubble fraction per stage as a metric, trace and picture of a window.

    Args:
        dirpath: where rank 0 writes ``trace.json`` and ``timeline.png`` (default:
            ``<trainer.default_root_dir>/timeline``).
        first_step: first training step kept for the trace (0: the pipeline filling up).
        num_steps: how many steps are kept (events of other steps are counted, then dropped).
        picture: also draw the Gantt chart (needs matplotlib).
    """

    def __init__(
        self, dirpath: str | None = None, first_step: int = 0, num_steps: int = 6, picture: bool = True
    ) -> None:
        if first_step < 0 or num_steps < 1:
            raise ValueError(f"PipelineTrace(first_step={first_step}, num_steps={num_steps}): need >= 0 and >= 1")
        self.dirpath = dirpath
        self.first_step, self.num_steps = first_step, num_steps
        self.picture = picture
        self.recorder: Recorder | None = None
        self.kept: list = []  # this rank's events of the kept steps
        self.kept_window: tuple[float, float] | None = None  # from the end of the step before the first kept one
        self.files: dict[str, Path] = {}
        self._last = 0.0
        self._busy = self._window = 0.0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from .strategy import PipeDream2BWStrategy

        if not isinstance(trainer.strategy, PipeDream2BWStrategy):
            raise ValueError(
                f"PipelineTrace records the pd2bw pipeline; this Trainer uses {type(trainer.strategy).__name__}. "
                "Use strategy='pd2bw' or drop the callback"
            )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.barrier("pipeline_trace")  # a common time origin for all ranks
        self.recorder = Recorder(time.perf_counter(), trainer.strategy.root_device)
        trainer.strategy.engine.observe(recorder=self.recorder)
        self._last = self.recorder.clock()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.recorder is None:
            return
        now = self.recorder.clock()  # on a GPU: the one wait per step of a traced run (actions use CUDA events)
        events = self.recorder.take()
        self._busy += busy_seconds(events)
        self._window += now - self._last
        step = trainer.global_step - 1  # global_step already counts this batch
        if self.first_step <= step < self.first_step + self.num_steps:
            self.kept.extend(events)
            self.kept_window = (self.kept_window or (self._last, now))[0], now
        self._last = now
        if trainer.global_step % max(1, trainer.log_every_n_steps) == 0 and self._window > 0:
            self._log_bubble(trainer, pl_module)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.recorder is not None and trainer.training:
            self.recorder.take()  # the drain and the validation are not pipeline bubble
            self._last = self.recorder.clock()

    def _log_bubble(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        mine = torch.tensor([float(strategy.grid.stage), 1.0 - self._busy / self._window], device=strategy.root_device)
        gathered = strategy.all_gather(mine).reshape(-1, 2).tolist()
        self._busy = self._window = 0.0
        by_stage: dict[int, list[float]] = {}
        for stage, bubble in gathered:
            by_stage.setdefault(int(stage), []).append(bubble)
        metrics = {f"bubble/stage{s}": sum(v) / len(v) for s, v in sorted(by_stage.items())}
        pl_module.log_dict(metrics, on_step=True, on_epoch=False)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.recorder is None:
            return
        strategy = trainer.strategy
        strategy.engine.observe()
        self.recorder = None
        mine = StageTimeline(strategy.global_rank, strategy.grid.stage, strategy.grid.replica, self.kept).to_dict()
        gathered: list[Any] = [None] * strategy.world_size if strategy.global_rank == 0 else []
        if dist.is_available() and dist.is_initialized():
            dist.gather_object(mine, gathered if strategy.global_rank == 0 else None, dst=0)
        else:
            gathered = [mine]
        if strategy.global_rank != 0:
            return
        timelines = [StageTimeline.from_dict(t) for t in gathered]
        out = Path(self.dirpath or Path(trainer.default_root_dir) / "timeline")
        self.files["trace"] = write_chrome_trace(out / "trace.json", timelines)
        if self.picture:
            from ..observe.gantt import draw_gantt

            title = (
                f"pd2bw {strategy.options.mode}: d={strategy.num_stages}, m={strategy.num_microbatches}, "
                f"w={strategy.data_parallel_size}, steps {self.first_step}-{self.first_step + self.num_steps - 1}"
            )
            self.files["picture"] = draw_gantt(timelines, out / "timeline.png", title)
        print(
            f"pipeline timeline: {', '.join(str(p) for p in self.files.values())} (open trace.json in ui.perfetto.dev)"
        )
