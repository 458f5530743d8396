"""torch internals the engine relies on, in one place (the engine's counterpart of ``lightning_pd2bw/lightning/compat.py``,
which holds Lightning's and may not be imported here: the engine runs without Lightning). Each is pinned by a
test (``tests/unit/test_compat.py``) that fails loudly if torch changes it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["optimizer_hooks_suspended", "run_post_hooks"]


@contextmanager
def optimizer_hooks_suspended(optimizer: torch.optim.Optimizer, pre: bool = True, post: bool = True) -> Iterator[None]:
    """Run ``optimizer.step()`` without its own step pre-hooks (``pre``) and/or post-hooks (``post``).

    torch keeps them in private ordered dicts; ``run_post_hooks`` runs the post-hooks afterwards.
    """
    saved = optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks
    if pre:
        optimizer._optimizer_step_pre_hooks = OrderedDict()
    if post:
        optimizer._optimizer_step_post_hooks = OrderedDict()
    try:
        yield
    finally:
        optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks = saved


def run_post_hooks(optimizer: torch.optim.Optimizer) -> None:
    """The optimizer's own step post-hooks, in registration order, as ``optimizer.step()`` calls them (its
    positional arguments include the optimizer itself)."""
    for hook in list(optimizer._optimizer_step_post_hooks.values()):
        hook(optimizer, (optimizer,), {})
