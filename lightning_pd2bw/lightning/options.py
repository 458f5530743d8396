"""The Lightning strategy's own options, ``StrategyOptions``: what it does beside running the pipeline (plan the
layout at start-up, detect failures, save checkpoints). The engine never reads them; its options are
``engine/options.py``'s ``PipelineOptions``. The strategy's keywords and ``pd2bw-train``'s ``strategy.*`` keys are
the flat union of both (the Hydra schema is generated from both, ``cli/schemas.py``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..engine import layout as rules
from ..engine.options import PipelineOptions

PLANS = (None, "auto")
STRATEGY_KEYS = rules.Keys(where="PipeDream2BWStrategy: ", call="PipeDream2BWStrategy")  # how messages name options


@dataclass(frozen=True)
class StrategyOptions:
    """What the strategy does beside the pipeline. Checked when built, alone and (``check``) against the pipeline's
    options; a bad field raises ``ValueError`` naming it as the caller's users write it.

    Args:
        plan: ``"auto"``: at start-up, profile the model on this device, measure the links and choose
            depth, microbatch size and recomputation with the planner (``lightning_pd2bw.planner``);
            ``num_stages`` and ``num_microbatches`` are then chosen, not given.
        global_batch_size: with ``plan="auto"``, the samples per optimizer step over all replicas
            (default: the dataloader's batch size x world size, as DDP would use).
        failure_timeout: seconds without a heartbeat after which a rank counts as dead; every other rank
            then exits (code 75) naming it, instead of waiting in a collective (``None``: off).
        hang_timeout: seconds without progress (no action executed by a rank and the ranks it watches) during
            training after which the job counts as stuck: every rank prints where it is and its Python stack,
            and exits (code 75). Must exceed the longest single action or checkpoint write (``None``: off;
            needs ``failure_timeout``).
        async_checkpoint: save checkpoints asynchronously (``torch.distributed.checkpoint.async_save``): training
            waits only while each rank copies its state to host memory; the files are written, and the checkpoint
            published, in the background over a gloo group of its own.
        requeue: under SLURM, a preempted or timed-out job (SIGTERM) requeues itself with its own job ID
            (``scontrol requeue``) once ``last.ckpt`` is written (``lightning/slurm.py``); False: it only exits 75.
        keys: how messages name the options (not an option).
    """

    plan: str | None = None
    global_batch_size: int | None = None
    failure_timeout: float | None = 180.0
    hang_timeout: float | None = 600.0
    async_checkpoint: bool = False
    requeue: bool = True
    keys: rules.Keys = field(default=STRATEGY_KEYS, compare=False, repr=False)

    def __post_init__(self) -> None:
        keys = self.keys
        if self.plan not in PLANS:
            raise ValueError(f"{keys.named('plan', self.plan)} is invalid; valid: None (give num_stages) or 'auto'")
        if self.global_batch_size is not None and self.plan != "auto":
            raise ValueError(
                f"{keys.named('global_batch_size', self.global_batch_size)} is used with plan='auto' only; otherwise "
                "the dataloader's batch size is each replica's batch"
            )
        if self.global_batch_size is not None and not self.global_batch_size > 0:
            raise ValueError(f"{keys.named('global_batch_size', self.global_batch_size)} must be > 0")
        for name, what in (("failure_timeout", "failure detection"), ("hang_timeout", "progress checks")):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{keys.named(name, value)} must be > 0 seconds, or None to turn {what} off")

    def check(self, pipeline: PipelineOptions) -> None:
        """What ``plan="auto"`` leaves to the planner must not be given in the pipeline's options."""
        keys = self.keys
        if self.plan != "auto":
            return
        if pipeline.num_stages is not None or pipeline.num_microbatches is not None:
            raise ValueError(
                f"{keys.named('plan', 'auto')} chooses num_stages and num_microbatches itself; leave both unset "
                "(or drop plan='auto' to set them by hand)"
            )
        if pipeline.layers_per_stage is not None:
            raise ValueError(
                f"{keys.named('plan', 'auto')} cuts the model itself; leave "
                f"{keys.named('layers_per_stage', list(pipeline.layers_per_stage))} unset"
            )

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "keys")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], keys: rules.Keys = STRATEGY_KEYS) -> StrategyOptions:
        """The strategy's options among the flat ``values`` (e.g. a Hydra ``strategy`` node; other keys are left
        out). ``check`` them against the pipeline's."""
        return cls(**{name: values[name] for name in cls.names() if name in values}, keys=keys)
