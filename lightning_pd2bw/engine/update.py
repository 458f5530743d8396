"""The update of one batch, identical on every stage (plain PyTorch), as the schedule's actions run it.

``schedule.update(b)`` places the parts of batch b's update (``engine/schedule.py``); ``UpdateRule.handlers``
registers each in the executor's ``{Kind: handler}`` table:
  REDUCE(b)      the next weight version made writable (2BW: the stale buffer is recycled; first, so that the
                 hooks, clipping and the step below see the newest weights); gradients averaged over
                 the data-parallel replicas (``grad_buckets.py``: their all-reduces started during the batch's last
                 backward; REDUCE waits for them), then summed over the stages that share a
                 parameter (GPT's tied embedding); REDUCE_DEFER(b) only launches those sums (2BW without
                 clipping), and TIED_STEP(b), placed before batch b+2's first forward, applies their update;
  CHECK(b)       the non-finite policy: ``stop`` raises (without a host sync: on a GPU at the first update after
                 the flags reached the host, and at every drain), ``skip`` agrees over the pipeline and drops b;
  HOOKS(b)       the ``before_step`` hook once per optimizer (under Lightning: ``on_before_optimizer_step`` of
                 the callbacks, then of the LightningModule);
  CLIP(b)        clipping: by the global norm over all stages
                 (``clip_mode="global"``, one all-reduce of a scalar) or per stage, over every optimizer's
                 parameters;
  STEP(b)        ``step()`` of every optimizer, in order, with the hyper-parameters (lr, ...) batch b was
                 fed with; 2BW's delay correction (``delay_correction.py``); the optimizers' step post-hooks
                 (e.g. sparsity masks) on the new version; gradients cleared.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import gradients
from . import schedule as S
from .delay_correction import ErrorFeedback
from .grad_buckets import GradientBuckets
from .ledger import BatchLedger
from .torch_compat import optimizer_hooks_suspended, run_post_hooks

CLIP_MODES = ("global", "stage")
NONFINITE_POLICIES = ("stop", "skip")


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every group's settings but its parameters (what a batch's update must use)."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


@dataclass
class TiedParameter:
    """A parameter several stages hold (a tied weight): its group, the rank that broadcasts it at the start, and
    whether this stage counts it in the clip norm (only the first stage holding it does)."""

    param: nn.Parameter
    group: Any
    source: int
    counts_for_norm: bool


@dataclass
class UpdatePolicy:
    clip_val: float | None = None
    clip_algorithm: str = "norm"  # "norm" | "value"
    clip_mode: str = "global"
    on_nonfinite: str = "stop"  # clip_mode and on_nonfinite are checked with the other options (options.py)


@dataclass
class UpdateRule:
    """Replica averaging, tied sums, the non-finite policy, clipping and the optimizer step of one stage."""

    mode: str
    optimizers: list[torch.optim.Optimizer]
    params: list[nn.Parameter]  # this stage's own parameters
    shared: list[TiedParameter]
    groups: Any  # grid.Groups
    data_parallel_size: int
    device: torch.device
    ledger: BatchLedger
    policy: UpdatePolicy
    correction: ErrorFeedback | None = None
    before_step: Callable[[torch.optim.Optimizer], None] | None = None
    describe: Callable[[], str] = lambda: "this rank"
    names: Callable[[], dict[int, list[str]]] = dict  # id(parameter) -> its names, for messages
    info: Callable[[str], None] = print
    executor: Any = None  # the StageExecutor (its weight versions)
    buckets: GradientBuckets | None = None  # width > 1: the replicated gradients, all-reduced during the backward
    skipped_updates: list[int] = field(default_factory=list)
    finite_watch: gradients.FiniteWatch = field(default_factory=gradients.FiniteWatch)

    def handlers(self) -> dict[S.Kind, Callable[[S.Action], None]]:
        """The update's parts, as the schedule places them, for the executor's table (``executor.register``)."""
        return {
            S.REDUCE: lambda action: self.reduce(action.batch),
            S.REDUCE_DEFER: lambda action: self.reduce(action.batch, deferred=True),
            S.CHECK: lambda action: self.check(action.batch),
            S.HOOKS: lambda action: self.hooks(action.batch),
            S.CLIP: lambda action: self.clip(action.batch),
            S.STEP: lambda action: self.step(action.batch),
            S.TIED_STEP: lambda action: self.tied_step(action.batch),
        }

    def reduce(self, batch: int, deferred: bool = False) -> None:
        """REDUCE(b): the update begins (the next weight version made writable), then average over the replicas,
        sum the tied gradients over their stages (REDUCE_DEFER: only launch the sums; TIED_STEP(b) applies them)."""
        if self.executor is not None:
            self.executor.begin_update()
        shared = [(s.param, s.group) for s in self.shared]
        replicated = self.params
        if self.buckets is not None:  # started during the last backward; the tied parameters are not in them
            self.buckets.finish()
            replicated = [s.param for s in self.shared]
        gradients.average_over_replicas(replicated, self.groups.replica, self.data_parallel_size)
        if deferred:
            self.ledger.defer(batch, gradients.launch_shared_sums(shared), [[] for _ in self.optimizers])
        else:
            gradients.sum_shared(shared)

    def check(self, batch: int) -> None:
        """CHECK(b): the non-finite policy; under "skip" a batch all stages found non-finite is not applied."""
        if not self._gradients_finite(batch):
            self.ledger.skip(batch)

    def hooks(self, batch: int) -> None:
        """HOOKS(b): the before-step hooks, once per optimizer (Lightning: ``on_before_optimizer_step`` of the
        callbacks, then of the module; e.g. a sparsity callback masks the gradients here)."""
        if self.before_step is not None and not self.ledger.is_skipped(batch):
            for optimizer in self.optimizers:
                self.before_step(optimizer)

    def clip(self, batch: int) -> None:
        """CLIP(b): clipping, by the global norm over the pipeline or each stage's own."""
        if not self.ledger.is_skipped(batch):
            self._clip_gradients()

    def step(self, batch: int) -> None:
        """STEP(b), on the weight version REDUCE(b) made writable: every optimizer's step with batch b's
        hyper-parameters, 2BW's delay correction, the optimizers' post-hooks; gradients cleared."""
        hparams = self.ledger.take_hparams(batch)
        if self.ledger.take_skip(batch):
            self.zero_grad()
            return
        deferred_hparams = self.ledger.deferred_hparams(batch)
        correction = self.correction if self.mode == "2bw" else None
        with ExitStack() as stack:
            if deferred_hparams is not None:  # the tied update later uses what this step used, after every pre-hook
                for index, optimizer in enumerate(self.optimizers):
                    record = deferred_hparams.__setitem__
                    handle = optimizer.register_step_pre_hook(
                        lambda opt, *_, i=index, r=record: r(i, hyperparameters(opt))
                    )
                    stack.callback(handle.remove)
            self.step_optimizers(hparams, post_hooks=correction is None)
        if correction is not None:
            versions = self.executor.versions
            before = versions.weights_of(versions.latest - 1)
            if deferred_hparams is not None:  # the tied parameters are corrected with their deferred update
                deferred = {id(s.param) for s in self.shared}
                moved = [(p, w) for p, w in zip(self.params, before, strict=True) if id(p) not in deferred]
                correction.apply([w for _, w in moved], stale=batch >= 1, parameters=[p for p, _ in moved])
            else:
                correction.apply(before, stale=batch >= 1)
            for optimizer in self.optimizers:
                run_post_hooks(optimizer)
        self.zero_grad()

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)
        if self.buckets is not None:  # the gradients live in the buckets: zeroed, the views attached again
            self.buckets.zero()

    def _gradients_finite(self, batch: int) -> bool:
        """The non-finite policy: ``stop`` raises on the stage that sees it; ``skip`` agrees over the pipeline
        (replicas already hold the same averaged gradients) and every stage skips batch ``batch``'s update."""
        if self.policy.on_nonfinite == "stop":
            self.finite_watch.push(self.ledger.global_step(batch), self.params)
            self.raise_if_nonfinite()
            return True
        # skip: the decision is needed before this update (the one host sync per update of this policy)
        flag = gradients.nonfinite_flag(self.params, self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.groups.pipeline)
        if flag.item() == 0:
            return True
        step = self.ledger.global_step(batch)
        self.skipped_updates.append(step)
        self.info(
            f"pd2bw: non-finite gradients in the batch of step {step}: its update is skipped on "
            f"every stage ({len(self.skipped_updates)} skipped so far)"
        )
        return False

    def raise_if_nonfinite(self, wait: bool = False) -> None:
        """``stop``: raise for the first update whose gradients were non-finite, once its flags are on the host
        (``wait=True``: wait for every pending one, e.g. before a drain's checkpoint or the end of training)."""
        found = self.finite_watch.poll(wait)
        if found is None:
            return
        step, bad = found
        names = self.names()
        shown = [names.get(id(p), ["?"])[0] for p in bad]
        raise FloatingPointError(
            f"non-finite gradients in the batch of step {step} on {self.describe()}"
            f" (e.g. {', '.join(shown[:3])}). Lower the learning rate or clip gradients (trainer.gradient_clip_val), "
            "check the data, or let the pipeline skip such updates: PipeDream2BWStrategy(on_nonfinite='skip')"
        )

    def step_optimizers(self, hparams: list[list[dict[str, Any]]], hooks: bool = True, post_hooks: bool = True) -> None:
        """``step()`` of every optimizer with a batch's hyper-parameters (those it was fed with);
        ``hooks=False`` completes an update whose step hooks already ran (a deferred tied parameter);
        ``post_hooks=False`` leaves the post-hooks to the caller (they run after the delay correction)."""
        for optimizer, values in zip(self.optimizers, hparams, strict=True):
            current = hyperparameters(optimizer)
            for group, saved in zip(optimizer.param_groups, values):
                group.update(saved)
            try:
                with optimizer_hooks_suspended(optimizer, pre=not hooks, post=not (hooks and post_hooks)):
                    optimizer.step()
            finally:
                for group, saved in zip(optimizer.param_groups, current):
                    group.update(saved)

    def defers_tied_sums(self) -> bool:
        """Whether the schedule may defer this stage's tied sums (``schedule.segment(defer_tied=...)``): 2BW,
        tied parameters here, no clipping (a clip norm needs the summed gradients at once) and not the skip
        policy (its decision needs them too)."""
        return (
            self.mode == "2bw" and bool(self.shared) and not self.policy.clip_val and self.policy.on_nonfinite != "skip"
        )

    def tied_step(self, batch: int) -> None:
        """TIED_STEP(b): apply batch b's deferred tied-parameter update to the newest weights.

        Placed before batch b + 2's first forward: the newest version is then the one that batch's update made,
        not yet read by anyone; every other gradient is left untouched.
        """
        entries, deferred_hparams = self.ledger.take_deferred(batch)
        sums = gradients.finish_shared_sums(entries)
        self.executor.versions.use_latest()
        others = [(p, p.grad) for p in self.params]
        for param in self.params:
            param.grad = None
        for param, grad in sums:
            param.grad = grad
        before = [param.detach().clone() for param, _ in sums] if self.correction is not None else []
        self.step_optimizers(deferred_hparams, hooks=False)
        if self.correction is not None:
            self.correction.apply(before, stale=batch >= 1, parameters=[param for param, _ in sums])
        for param, grad in others:
            param.grad = grad

    def _clip_gradients(self) -> None:
        clip_val = self.policy.clip_val
        if not clip_val:
            return
        if self.policy.clip_algorithm == "value":
            torch.nn.utils.clip_grad_value_(self.params, clip_val)
            return
        not_counted = {id(s.param) for s in self.shared if not s.counts_for_norm}
        group = self.groups.pipeline if self.policy.clip_mode == "global" else None
        gradients.clip_by_norm(self.params, clip_val, not_counted, group, self.device)


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
