"""The update's last part, STEP and PUBLISH: the stage's optimizers, 2BW's delay correction and the sharded
optimizer's broadcasts (``update.py`` says when they run); and the optimizers' view of one stage
(``local_optimizers``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from ..schedules import schedule as S
from ..state.ledger import BatchLedger
from ..state.versions import WeightVersions
from ..torch_compat import optimizer_hooks_suspended, run_post_hooks
from .collectives import Collective
from .delay_correction import ErrorFeedback
from .sharding import OptimizerShards
from .update import SetAside, UpdatePart, UpdateShape


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every group's settings but its parameters (what a batch's update must use)."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


class Stepper(UpdatePart):
    """STEP(b), on the weight version REDUCE(b) made writable: every optimizer's ``step()`` with the hyper-parameters
    batch b was fed with (unless the batch is skipped); 2BW's delay correction (``correction``, built under 2BW only)
    and then the optimizers' post-hooks; with the optimizer sharded (``shards``), the owners' broadcasts of the new
    weights launched, on every replica, skipped or not (the same broadcasts in the same order). PUBLISH(b) waits for
    them: nothing reads the new version before (its first reader is batch b + 2's first forward, and a step's end,
    where callbacks and checkpoints read the weights, follows PUBLISH)."""

    def __init__(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        ledger: BatchLedger,
        versions: WeightVersions,
        correction: ErrorFeedback | None = None,
        shards: OptimizerShards | None = None,
    ) -> None:
        self.optimizers, self.ledger, self.versions = list(optimizers), ledger, versions
        self.correction, self.shards = correction, shards
        self.publishing: dict[int, Callable[[], None]] = {}  # batch -> the wait for its owners' broadcasts

    ACTIONS: ClassVar[dict[S.Kind, str]] = {S.STEP: "step", S.PUBLISH: "publish"}

    @staticmethod
    def collectives(shape: UpdateShape) -> list[Collective]:
        """The sharded optimizer: one broadcast per owner, replica 0's first, launched at STEP and waited for at
        PUBLISH (``OptimizerShards.launch_broadcasts``: an owner's tensors back to back, one message each; an owner
        with no tensor issues none, so a stage with fewer tensors than replicas has fewer)."""
        if not shape.owners_broadcast:
            return []
        return [OptimizerShards.WEIGHTS.times(1, what=f"weights of {owner}") for owner in range(shape.width)]

    def step(self, batch: int, aside: SetAside) -> None:
        hparams = self.ledger.take_hparams(batch)
        if not self.ledger.take_skip(batch):
            with aside.in_grad():
                self._step(batch, hparams)
        if self.shards is not None:
            aside.writable()  # the storages the step wrote (a skipped step: the new version, a copy of the last)
            messages = self.versions.publishable if self.versions.sharded_master else None  # the compute dtype
            self.publishing[batch] = self.shards.launch_broadcasts(messages)

    def publish(self, batch: int, aside: SetAside | None) -> None:
        wait = self.publishing.pop(batch, None)
        if wait is not None:
            wait()

    def at_drain(self) -> None:
        for batch in sorted(self.publishing):
            self.publish(batch, None)

    def _step(self, batch: int, hparams: list[list[dict[str, Any]]]) -> None:
        correction = self.correction
        before = None if correction is None else self.versions.weights_before_step(correction.parameters)
        self.step_optimizers(hparams, post_hooks=correction is None)
        if correction is not None:
            correction.apply(before, stale=batch >= 1, scratch=self.versions.mixed)  # mixed: a master copy
            for optimizer in self.optimizers:
                run_post_hooks(optimizer)

    def step_optimizers(self, hparams: list[list[dict[str, Any]]], post_hooks: bool = True) -> None:
        """``step()`` of every optimizer with a batch's hyper-parameters (those it was fed with);
        ``post_hooks=False`` leaves the post-hooks to the caller (they run after the delay correction)."""
        for optimizer, values in zip(self.optimizers, hparams, strict=True):
            current = hyperparameters(optimizer)
            for group, saved in zip(optimizer.param_groups, values):
                group.update(saved)
            try:
                with optimizer_hooks_suspended(optimizer, pre=False, post=not post_hooks):
                    optimizer.step()
            finally:
                for group, saved in zip(optimizer.param_groups, current):
                    group.update(saved)


def local_optimizers(
    optimizers: Sequence[torch.optim.Optimizer], params: Sequence[nn.Parameter], names: dict[int, list[str]]
) -> None:
    """Keep only this stage's parameters in the optimizers' groups (other stages' are placeholders here); a
    parameter in two optimizers is an error naming it."""
    local = {id(p) for p in params}
    owner: dict[int, int] = {}
    for index, optimizer in enumerate(optimizers):
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in local]
            for param in group["params"]:
                if owner.setdefault(id(param), index) != index:
                    name = names.get(id(param), ["?"])[0]
                    raise ValueError(
                        f"parameter {name} is in optimizers {owner[id(param)]} and {index}: give each parameter to "
                        "one optimizer"
                    )
