"""The update of one batch, identical on every stage (plain PyTorch), as the schedule's actions run it.

``schedule.update(b)`` places the parts of batch b's update (``engine/schedule.py``); ``UpdateRule.handlers``
registers each in the executor's ``{Kind: handler}`` table. Under 2BW the update of batch b is first read by batch
b + 2's first forward, so it runs while batch b + 1 computes (flush and gpipe run the parts back to back):
  REDUCE(b)      right after b's last backward: the next weight version made writable (2BW: the stale buffer is
                 recycled); the gradients set aside (one more gradient buffer: the next batch's backwards
                 accumulate afresh): with replicas, their buckets handed over with the all-reduces that started
                 during the batch's last backward still in flight (``grad_buckets.launch``: they finish behind
                 the next batch's compute); the sums of the tied parameters' gradients over the stages holding
                 them launched (their replica average, apart from the buckets, waited for here);
  CHECK(b)       (2BW: once every stage has reached REDUCE(b), so the wait is never on a peer) the replica average
                 and the tied sums waited for; batch b's gradients in ``.grad`` again (the next batch's aside until
                 NORM); the non-finite
                 policy: ``stop`` queues its check (raised without a host sync: on a GPU at the first update after
                 the flags reached the host, and at every drain), ``skip`` launches its flag over the pipeline;
  HOOKS(b)       ``skip``: the flag read (the batch dropped on every stage if any found it non-finite); the
                 ``before_step`` hook once per optimizer (under Lightning: ``on_before_optimizer_step`` of the
                 callbacks, then of the LightningModule; e.g. the sparsity masks on the gradients);
  NORM(b)        global clipping: this stage's squared norm launched as a sum over the pipeline, not waited for;
                 then the next batch's gradients back in ``.grad``;
  CLIP(b)        (2BW: at the head of step b + 2) batch b's gradients in ``.grad`` again; clipped by the global norm
                 NORM launched (waited for here: every stage launched it a while ago) or per stage, over every
                 optimizer's parameters;
  STEP(b)        ``step()`` of every optimizer, in order, with the hyper-parameters (lr, ...) batch b was fed with;
                 2BW's delay correction (``delay_correction.py``); the optimizers' step post-hooks (e.g. sparsity
                 masks) on the new version; then the next batch's gradients back in ``.grad``.
The rule is unchanged, W(t+1) = W(t) - lr * grad f(W(t-1)): only when the work is done moved.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from . import gradients
from . import schedule as S
from .delay_correction import ErrorFeedback
from .grad_buckets import GradientBuckets
from .layout import Mode
from .ledger import BatchLedger
from .options import PipelineOptions
from .sharding import OptimizerShards
from .torch_compat import optimizer_hooks_suspended, run_post_hooks
from .versions import WeightVersions


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
class SetAside:
    """Batch b's update from REDUCE(b) to STEP(b): its gradients (one per parameter, None where none arrived) and
    its collectives in flight; while its parts run, the gradients the next batch accumulated (``current``)."""

    grads: list[torch.Tensor | None]
    tied: list[Any]  # the tied sums' works
    launched: Any = None  # width > 1: the buckets' replica all-reduces in flight (grad_buckets.Launched)
    flag: torch.Tensor | None = None  # non-finite gradients anywhere in the pipeline ("skip")
    flag_work: Any = None
    squares: torch.Tensor | None = None  # this stage's squared norm, summed over the pipeline once `norm` is done
    norm: Any = None
    current: list[torch.Tensor | None] | None = None  # the next batch's gradients, aside while b's parts run

    @property
    def nbytes(self) -> int:
        held = sum(g.numel() * g.element_size() for g in self.grads if g is not None)
        if self.launched is not None:  # the replicated gradients, still in their buckets
            held += sum(b.views[0].element_size() * sum(v.numel() for v in b.views) for b in self.launched.buckets)
        return held


@dataclass
class UpdateRule:
    """Replica averaging, tied sums, the non-finite policy, clipping and the optimizer step of one stage."""

    options: PipelineOptions  # the mode, clip_mode and on_nonfinite
    optimizers: list[torch.optim.Optimizer]
    params: list[nn.Parameter]  # this stage's own parameters
    shared: list[TiedParameter]
    groups: Any  # grid.Groups
    data_parallel_size: int
    device: torch.device
    ledger: BatchLedger
    clip_val: float | None = None  # Lightning's gradient_clip_val (None: no clipping)
    clip_algorithm: str = "norm"  # "norm" | "value"
    correction: ErrorFeedback | None = None
    before_step: Callable[[torch.optim.Optimizer], None] | None = None
    describe: Callable[[], str] = lambda: "this rank"
    names: Callable[[], dict[int, list[str]]] = dict  # id(parameter) -> its names, for messages
    info: Callable[[str], None] = print
    versions: WeightVersions | None = None  # this stage's weight versions (None: the parameters are the only one)
    buckets: GradientBuckets | None = None  # width > 1: the replicated gradients, all-reduced during the backward
    shards: OptimizerShards | None = None  # width > 1 and shard_optimizer: who steps what, and the broadcasts after
    skipped_updates: list[int] = field(default_factory=list)
    finite_watch: gradients.FiniteWatch = field(default_factory=gradients.FiniteWatch)
    pending: dict[int, SetAside] = field(default_factory=dict)  # batch -> its update between REDUCE and STEP
    peak_pending_bytes: int = 0

    @property
    def mode(self) -> Mode:
        return Mode(self.options.mode)

    def handlers(self) -> dict[S.Kind, Callable[[S.Action], None]]:
        """The update's parts, as the schedule places them, for the executor's table (``StageExecutor(handlers=)``)."""
        return {
            S.REDUCE: lambda action: self.reduce(action.batch),
            S.CHECK: lambda action: self.check(action.batch),
            S.HOOKS: lambda action: self.hooks(action.batch),
            S.NORM: lambda action: self.norm(action.batch),
            S.CLIP: lambda action: self.clip(action.batch),
            S.STEP: lambda action: self.step(action.batch),
        }

    @property
    def pending_bytes(self) -> int:
        """The set-aside gradients held now (2BW: one batch's, from its REDUCE to its STEP, beside the next batch's
        accumulating ones; flush and gpipe hold them only within their update)."""
        return sum(aside.nbytes for aside in self.pending.values()) if self.mode.double_buffered else 0

    def reduce(self, batch: int) -> None:
        """REDUCE(b): the update begins (the next weight version made writable); average over the replicas, set
        the gradients aside, launch the tied sums."""
        if self.versions is not None:
            self.versions.begin_update()  # the update's hooks, clipping and step all see the newest weights
        tied = {id(s.param) for s in self.shared}
        replicated, launched = self.params, None
        if self.buckets is not None:  # started during the last backward; the tied parameters are not in them
            replicated = [s.param for s in self.shared]
            grads_of = {id(p): p.grad for p in replicated}
            launched = self.buckets.launch(self.mode.double_buffered)  # in flight until CHECK
        gradients.average_over_replicas(replicated, self.groups.replica, self.data_parallel_size)
        grads: list[torch.Tensor | None] = []
        for param in self.params:
            grad = param.grad if launched is None else grads_of.get(id(param))  # bucket views come at CHECK
            if grad is None and id(param) in tied:
                grad = torch.zeros_like(param)  # every holder joins the sum
            grads.append(grad)
            if launched is None or id(param) in tied:
                param.grad = None
        self.attach_gradients(buckets=False)  # mixed weights: the next batch's float32 tied gradients
        position = {id(p): i for i, p in enumerate(self.params)}
        works = [
            dist.all_reduce(grads[position[id(s.param)]], group=s.group, async_op=True)  # type: ignore[arg-type]
            for s in self.shared
        ]
        self.pending[batch] = SetAside(grads, works, launched)
        if self.mode.double_buffered:  # flush and gpipe complete the update at once: nothing accumulates beside it
            self.peak_pending_bytes = max(self.peak_pending_bytes, self.pending_bytes)

    def attach_gradients(self, buckets: bool = True) -> None:
        """Before a batch's compute: every gradient the batch accumulates into is in place (the buckets' views;
        mixed-precision weights: float32 gradients of the tied parameters, which autograd then adds into)."""
        if buckets and self.buckets is not None:
            self.buckets.attach()
        if self.versions is not None and self.versions.mixed:  # the parameters are on the master here
            for shared in self.shared:
                if shared.param.grad is None:
                    shared.param.grad = torch.zeros_like(shared.param)

    def _swap_in(self, aside: SetAside) -> None:
        """Batch b's gradients into ``.grad`` (on the newest weights), the next batch's aside."""
        if self.versions is not None:
            self.versions.use_writable()  # the version REDUCE(b) made writable (mixed: the master)
        aside.current = [param.grad for param in self.params]
        for param, grad in zip(self.params, aside.grads):
            param.grad = grad

    def _swap_out(self, aside: SetAside) -> None:
        """The next batch's gradients back into ``.grad``; batch b's (as hooks may have replaced them) aside."""
        aside.grads = [param.grad for param in self.params]
        for param, grad in zip(self.params, aside.current or [None] * len(self.params)):
            param.grad = grad  # bucket views under width > 1, accumulated meanwhile
        aside.current = None

    def check(self, batch: int) -> None:
        """CHECK(b): batch b's gradients in ``.grad``, its tied sums waited for; the non-finite policy."""
        aside = self.pending[batch]
        if aside.launched is not None:  # the replica average, finished behind the next batch's compute
            averaged = self.buckets.complete(aside.launched)
            aside.grads = [averaged.get(id(p), g) for p, g in zip(self.params, aside.grads)]
            aside.launched = None
        for work in aside.tied:
            work.wait()
        self._swap_in(aside)
        if self.options.on_nonfinite == "stop":
            self.finite_watch.push(self.ledger.global_step(batch), self.params)
            self.raise_if_nonfinite()
            return
        # skip: every stage's flag over the pipeline (replicas already hold the same averaged gradients, or with
        # sharded gradients agree on the owners' flags first)
        aside.flag = gradients.nonfinite_flag([p.grad for p in self.params if p.grad is not None], self.device)
        if self.gradients_sharded:
            dist.all_reduce(aside.flag, op=dist.ReduceOp.MAX, group=self.groups.shard)
        aside.flag_work = dist.all_reduce(aside.flag, op=dist.ReduceOp.MAX, group=self.groups.pipeline, async_op=True)

    def hooks(self, batch: int) -> None:
        """HOOKS(b): under "skip", the pipeline's verdict; the before-step hooks, once per optimizer (Lightning:
        ``on_before_optimizer_step`` of the callbacks, then of the module; e.g. a sparsity callback masks the
        gradients here)."""
        aside = self.pending[batch]
        if aside.flag_work is not None and not self._agreed_finite(batch, aside):
            self.ledger.skip(batch)
        if self.before_step is not None and not self.ledger.is_skipped(batch):
            for optimizer in self.optimizers:
                self.before_step(optimizer)

    def norm(self, batch: int) -> None:
        """NORM(b): global clipping: this stage's squared norm launched as a sum over the pipeline; then the next
        batch's gradients back."""
        aside = self.pending[batch]
        if self.clip_val and self.clip_algorithm == "norm" and self.options.clip_mode == "global":
            if not self.ledger.is_skipped(batch):  # every stage skips alike: the collective is issued by all or none
                aside.squares = self._squared_norm()
                aside.norm = dist.all_reduce(aside.squares, group=self.groups.pipeline, async_op=True)
        self._swap_out(aside)

    def clip(self, batch: int) -> None:
        """CLIP(b): batch b's gradients in ``.grad`` again; clipped by the global norm (NORM's) or the stage's."""
        aside = self.pending[batch]
        self._swap_in(aside)
        if self.ledger.is_skipped(batch) or not self.clip_val:
            return
        if self.clip_algorithm == "value":
            torch.nn.utils.clip_grad_value_(self.params, self.clip_val)
            return
        squares = aside.squares
        if aside.norm is not None:
            aside.norm.wait()
        else:  # clip_mode="stage": this stage's norm alone
            squares = self._squared_norm()
        gradients.scale_to_norm([p.grad for p in self.params if p.grad is not None], squares, self.clip_val)

    def step(self, batch: int) -> None:
        """STEP(b), on the weight version REDUCE(b) made writable: every optimizer's step with batch b's
        hyper-parameters, 2BW's delay correction, the optimizers' post-hooks; then the next batch's gradients back."""
        hparams = self.ledger.take_hparams(batch)
        aside = self.pending.pop(batch)
        if not self.ledger.take_skip(batch):
            correction = self.correction if self.mode.double_buffered else None
            before = None
            if correction is not None:
                assert self.versions is not None, "2BW's delay correction reads the previous weight version"
                before = self.versions.weights_before_step(correction.parameters)
            self.step_optimizers(hparams, post_hooks=correction is None)
            if correction is not None:
                correction.apply(before, stale=batch >= 1, scratch=self.versions.mixed)  # mixed: a master copy
                for optimizer in self.optimizers:
                    run_post_hooks(optimizer)
        if self.shards is not None:  # every replica, skipped or not: the same broadcasts in the same order
            self.shards.broadcast_weights()
        self._swap_out(aside)
        if self.buckets is not None and not self.mode.double_buffered:
            self.buckets.zero()  # flush and gpipe: the one bucket set becomes the next batch's

    @property
    def gradients_sharded(self) -> bool:
        """Each replica holds the averaged gradients of the parameters it owns only (``shard_gradients``)."""
        return self.buckets is not None and self.buckets.sharded

    def _squared_norm(self) -> torch.Tensor:
        """This stage's squared gradient norm (a tied parameter counted on the first stage holding it only).
        Sharded gradients: the owners' parts summed over the replicas (on ``shard``'s communicator, where nothing
        of the next batch is queued), the tied parameters, whole on every replica, added after."""
        not_counted = {id(s.param) for s in self.shared if not s.counts_for_norm}
        counted = [p for p in self.params if p.grad is not None and id(p) not in not_counted]
        if not self.gradients_sharded:
            return gradients.squared_norm([p.grad for p in counted], self.device)
        tied = {id(s.param) for s in self.shared}
        owned = gradients.squared_norm([p.grad for p in counted if id(p) not in tied], self.device)
        dist.all_reduce(owned, group=self.groups.shard)
        return owned + gradients.squared_norm([p.grad for p in counted if id(p) in tied], self.device)

    def _agreed_finite(self, batch: int, aside: SetAside) -> bool:
        """``skip``: the flag CHECK launched over the pipeline (the one host sync per update of this policy)."""
        aside.flag_work.wait()
        if aside.flag.item() == 0:
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
