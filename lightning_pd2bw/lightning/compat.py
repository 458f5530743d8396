"""Lightning internals this package relies on, in one place, each pinned by a test (tests/unit/test_compat.py).

Every name here is private to Lightning; if an upgrade moves one, the import below fails at once (loudly)
instead of a feature silently doing nothing. The re-exported helpers (the process group's start, the launcher,
the collectives Lightning's own strategies use, moving optimizer state) keep their behaviour; the strategy
imports them from here, never from Lightning's private modules.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
from lightning.fabric.utilities.device_dtype_mixin import _update_properties
from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available as all_gather_if_distributed
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device as default_backend_for_device,
)
from lightning.fabric.utilities.distributed import _init_dist_connection as init_process_group
from lightning.fabric.utilities.distributed import _sync_ddp_if_available as reduce_if_distributed
from lightning.fabric.utilities.optimizer import _optimizers_to_device as optimizers_to_device
from lightning.pytorch.core import optimizer as lightning_optimizer
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher as SubprocessScriptLauncher
from lightning.pytorch.trainer import call as lightning_call
from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs, _reinstantiate_wrapped_cls
from torch import nn

__all__ = [  # Lightning's own helpers, used as they are (re-exported: nothing else imports Lightning's privates)
    "PatientSubprocessLauncher",
    "all_gather_if_distributed",
    "default_backend_for_device",
    "init_process_group",
    "optimizers_to_device",
    "reduce_if_distributed",
    # ours, each around a Lightning or torch internal
    "before_optimizer_step_hooks",
    "defer_checkpoint_links",
    "combined_train_loader",
    "mark_sigterm_received",
    "place_module",
    "reinstantiate_dataloader",
    "replace_sigterm_check",
    "several_optimizers_allowed",
    "sigterm_handler_before_lightning",
    "skip_lightning_backward",
    "train_dataloader",
]


def place_module(module: nn.Module, device: torch.device) -> None:
    """Move a partially materialised module to ``device`` and tell Lightning where it is.

    Other stages' layers stay on the meta device, so ``module.to(device)`` cannot be used; ``_apply``
    moves the real tensors, and Lightning's device/dtype mixin is told the device, so that
    ``pl_module.device`` (which callbacks use for their collectives and memory reads) is the stage's
    device, not the CPU it was built on.
    """
    module._apply(lambda t: t if t.is_meta else t.to(device))
    _update_properties(module, device=torch.device(device))


def replace_sigterm_check(trainer: Any, check: Callable[[], None]) -> None:
    """Replace the training epoch loop's per-step SIGTERM broadcast (rank 0's flag, blocking) with ``check``."""
    loop = trainer.fit_loop.epoch_loop
    if not isinstance(loop, _TrainingEpochLoop) or not hasattr(loop, "_broadcast_sigterm_tensor"):
        raise RuntimeError(
            "this Lightning version has no _TrainingEpochLoop._broadcast_sigterm_tensor: update "
            "lightning_pd2bw.lightning.compat.replace_sigterm_check for it"
        )
    loop._broadcast_sigterm_tensor = check


def mark_sigterm_received(trainer: Any) -> None:
    """Set ``trainer.received_sigterm``: Lightning's loops raise ``SIGTERMException`` at the end of the batch."""
    trainer._signal_connector.received_sigterm = True


def sigterm_handler_before_lightning(trainer: Any) -> Any:
    """The SIGTERM handler installed before Lightning registered its own (a user's, or the default)."""
    return trainer._signal_connector._original_handlers.get(signal.SIGTERM)


def skip_lightning_backward(trainer: Any) -> None:
    """Lightning's automatic optimization skips ``zero_grad`` and ``backward`` (the switch its SWA callback uses):
    the pipeline engine owns both."""
    trainer.fit_loop._skip_backward = True


def train_dataloader(trainer: Any) -> Any:
    """The fit's training dataloader before Lightning wraps it (the planner samples a batch from it in ``setup``)."""
    return trainer.fit_loop._data_source.dataloader()


def combined_train_loader(trainer: Any) -> Any:
    """The fit loop's ``CombinedLoader`` of the training dataloaders (None before it is built)."""
    return trainer.fit_loop._combined_loader


@contextmanager
def several_optimizers_allowed() -> Iterator[None]:
    """Let ``configure_optimizers`` return several optimizers under automatic optimization.

    Lightning refuses that (its loop would step only the first), but under ``strategy="pd2bw"`` the engine
    steps every optimizer itself; Lightning still steps each optimizer's LR schedulers. The check that a
    ``training_step`` does not take ``optimizer_idx`` (the removed multi-optimizer API) is kept.
    """
    original = lightning_optimizer._validate_multiple_optimizers_support

    def only_optimizer_idx(optimizers: list[Any], model: Any) -> None:
        original(optimizers[:1], model)

    lightning_optimizer._validate_multiple_optimizers_support = only_optimizer_idx
    try:
        yield
    finally:
        lightning_optimizer._validate_multiple_optimizers_support = original


def reinstantiate_dataloader(loader: Any, sampler: Any, **overrides: Any) -> Any:
    """``loader`` re-created the way Lightning injects its ``DistributedSampler``: the same class with every
    argument it was built with (workers, ``pin_memory_device``, ``multiprocessing_context``, ...), a custom
    ``batch_sampler`` rebuilt around ``sampler``; ``overrides`` replace init arguments by name."""
    args, kwargs = _get_dataloader_init_args_and_kwargs(loader, sampler)
    args = list(args)
    names = list(getattr(loader, "__pl_saved_arg_names", ()))
    for name, value in overrides.items():
        if name in names[: len(args)]:
            args[names.index(name)] = value
        else:
            kwargs[name] = value
    return _reinstantiate_wrapped_cls(loader, *args, **kwargs)


def before_optimizer_step_hooks(trainer: Any, optimizer: torch.optim.Optimizer) -> None:
    """``on_before_optimizer_step``: the callbacks', then the LightningModule's, as Lightning's loop calls them."""
    lightning_call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
    lightning_call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)


def defer_checkpoint_links() -> None:
    """``ModelCheckpoint._link_checkpoint`` (``save_last="link"``) points ``last.ckpt`` at a checkpoint as soon as its
    save call returns; a strategy with ``defer_link(filepath, linkpath)`` returning True makes the link itself once
    that checkpoint is published (an asynchronous save: ``checkpoint/background.py``), so ``last.ckpt`` never points
    at a save that may not finish. Other strategies' links are made as before. Idempotent."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    original = ModelCheckpoint._link_checkpoint
    if getattr(original, "pd2bw_deferred", False):
        return

    def link(trainer: Any, filepath: str, linkpath: str) -> None:
        defer = getattr(trainer.strategy, "defer_link", None)
        if defer is not None and defer(filepath, linkpath):
            trainer.strategy.barrier()  # as Lightning's own link does
            return
        original(trainer, filepath, linkpath)

    link.pd2bw_deferred = True  # type: ignore[attr-defined]
    ModelCheckpoint._link_checkpoint = staticmethod(link)


class PatientSubprocessLauncher(SubprocessScriptLauncher):
    """Lightning's launcher (``python train.py`` starting the other ranks), whose child-process observer waits
    ``grace`` seconds after a rank dies before it SIGKILLs the rest. Lightning's kills every rank within its 5 s poll,
    so the job's exit code is 137 (-9) before the project's watchdog (``observe/watchdog.py``) has named the failed
    rank and ended every rank with the documented code (75: resume from the last checkpoint). ``grace`` is the
    watchdog's detection bound (``failure_timeout``) plus a margin; Lightning's own kill stays the fallback."""

    def __init__(self, *args: Any, grace: float = 0.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.grace = grace

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        import lightning.pytorch.strategies.launchers.subprocess_script as script

        original = script._launch_process_observer
        script._launch_process_observer = lambda procs: _PatientObserver(procs, self.grace).start()
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        finally:
            script._launch_process_observer = original


class _PatientObserver(_ChildProcessObserver):
    def __init__(self, procs: list, grace: float) -> None:
        super().__init__(main_pid=os.getpid(), child_processes=procs)
        self.grace, self.failed_at = grace, None

    def _run(self) -> bool:
        codes = [proc.poll() for proc in self._child_processes]
        if all(code == 0 for code in codes):
            return True
        if not any(codes):  # none failed (yet)
            return False
        if all(code is not None for code in codes):  # every rank ended by itself (the watchdog's verdict)
            return True
        self.failed_at = self.failed_at if self.failed_at is not None else time.monotonic()
        if time.monotonic() - self.failed_at < self.grace:
            return False  # the watchdog names the failed rank and ends the others with its exit code
        return super()._run()  # Lightning's: SIGKILL every child and the main process
