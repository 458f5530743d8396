"""What a rank script under torchrun shares with the others: a Trainer over the CPU processes with Lightning's
console output off. A new behaviour across ranks is a ``run_*.py`` that builds its model and calls
``quiet_trainer(strategy, ...)``, plus a ``test_*.py`` that starts it with ``launch.torchrun_script`` and asserts on
what each rank wrote (docs/testing.md, "Adding a test")."""

from __future__ import annotations

import atexit
from typing import Any

import lightning.pytorch as pl

from lightning_pd2bw.engine.comm.grid import end_default_group

# every rank script ends its process group while the interpreter is whole: Lightning's DDP leaves it up and gloo's
# threads can abort the exit otherwise (SIGABRT after a passing run: the flaky CI failure of 2026-11-29)
atexit.register(end_default_group)

QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


def quiet_trainer(strategy: Any, devices: int = 2, **settings: Any) -> pl.Trainer:
    """``pl.Trainer`` on ``devices`` CPU processes with ``strategy``, no logger, checkpoints, progress bar or
    summary unless ``settings`` say otherwise (``logger=CSVLogger(...)``, ``callbacks=[ModelCheckpoint(...)]``)."""
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, **(QUIET | settings))
