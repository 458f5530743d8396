"""A run bounded by epochs, in steps: ``trainer.max_steps=-1`` (Lightning's default) with ``trainer.max_epochs=N``
becomes the step count those epochs take, before anything reads ``trainer.max_steps``. The recipes derive from it
the learning-rate schedule's end (``model.max_steps``), the sparsity schedule's steps and 2BW's synchronous start
(``engine/sync_start.py``): with -1 they were a learning rate at its floor one step after the warm-up, a
sparsity schedule ending at step 0 and no start at all."""

from __future__ import annotations

import math
from typing import Any

from .checks import ConfigError, world_size_of
from .run_folder import say


def settle_run_length(cfg: Any) -> None:
    """``trainer.max_steps`` <= 0: set it to the steps of ``trainer.max_epochs`` epochs of the training data (each
    replica's batches per epoch, as Lightning's ``DistributedSampler`` deals them, times the epochs, within
    ``trainer.limit_train_batches``), saying so; refused naming the keys where the run has no length."""
    from omegaconf import open_dict

    trainer = cfg.trainer
    if trainer.get("max_steps") is not None and trainer.max_steps > 0:
        return
    epochs = trainer.get("max_epochs")
    if epochs is None or epochs < 1:
        raise ConfigError(
            f"trainer.max_steps={trainer.get('max_steps')} and trainer.max_epochs={epochs}: the run has no length, "
            "and the learning-rate and sparsity schedules and 2BW's synchronous start are fractions of it; set "
            "trainer.max_steps=N or trainer.max_epochs=N (trainer.max_time alone does not say how many steps run)"
        )
    per_epoch = steps_per_epoch(cfg)
    limit = trainer.get("limit_train_batches")
    if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1:
        per_epoch = min(per_epoch, limit)
    elif isinstance(limit, float) and 0 < limit < 1:
        per_epoch = int(per_epoch * limit)
    if per_epoch < 1:
        raise ConfigError(
            f"the training data give no full step of global_batch_size={cfg.global_batch_size} sequences per epoch; "
            "use more data (data.paths), a smaller global_batch_size or a shorter data.seq_len"
        )
    with open_dict(cfg):
        trainer.max_steps = per_epoch * epochs
    say(
        f"trainer.max_epochs={epochs}: {per_epoch} steps an epoch, so trainer.max_steps={trainer.max_steps} (the "
        "learning-rate and sparsity schedules and 2BW's synchronous start follow it)"
    )


def steps_per_epoch(cfg: Any) -> int:
    """Each replica's batches per epoch: ``ceil(samples / width) // (global_batch_size / width)`` (the sampler pads
    the replicas' shares to equal length; the loader drops an incomplete batch). Under ``strategy.plan=auto`` the
    width is chosen at start-up: the global batch's count of the samples then."""
    from hydra.utils import instantiate

    data = instantiate(cfg.data, batch_size=1)
    data.setup("fit")
    samples = len(data.train_set)
    world = world_size_of(cfg.trainer)
    stages = cfg.strategy.get("num_stages") or world
    width = 1 if cfg.strategy.get("plan") == "auto" or world % stages else world // stages
    return math.ceil(samples / width) // max(1, cfg.global_batch_size // width)


def sync_steps_of(cfg) -> int:
    """2BW's synchronous start for this run: ``strategy.sync_steps``, or (null) the one rule at its length."""
    from ..engine.sync_start import sync_start_steps

    given = cfg.strategy.get("sync_steps")
    return sync_start_steps(cfg.trainer.max_steps) if given is None else given
