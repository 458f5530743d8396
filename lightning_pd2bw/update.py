"""The update of one batch, identical on every stage (a mixin of ``PipeDream2BWStrategy``).

Order inside one update (STEP of batch b):
  1. the next weight version is made writable (2BW: the stale buffer is recycled; the executor does it);
  2. gradients are averaged over the data-parallel replicas, then summed over the stages that share
     a parameter (GPT's tied embedding; under 2BW without clipping that sum is deferred, see
     ``_finish_deferred``);
  3. the non-finite policy: ``stop`` raises (without a host sync: on a GPU at the first update after the
     flags reached the host, and at every drain), ``skip`` agrees over the pipeline and drops the update;
  4. ``on_before_optimizer_step`` hooks (callbacks, then the LightningModule), once per optimizer;
  5. clipping: by the global norm over all stages (``clip_mode="global"``, one all-reduce of a
     scalar per step) or per stage (``clip_mode="stage"``), over every optimizer's parameters;
  6. ``step()`` of every optimizer, in ``configure_optimizers``' order, each with the hyper-parameters
     (lr, ...) that batch b's Lightning step had;
  7. 2BW with ``delay_correction``: the correction of the one-step delay (``pipeline/delay_correction.py``);
  8. the optimizers' step post-hooks (e.g. sparsity masks) run, on the new version;
  9. gradients are cleared.
"""

from __future__ import annotations

from contextlib import ExitStack, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from .compat import before_optimizer_step_hooks, optimizer_hooks_suspended, run_post_hooks
from .pipeline import gradients
from .pipeline.timeline import REDUCE, SHARED_STEP


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


class UpdatePath:
    """Replica averaging, tied sums, the non-finite policy, clipping and the optimizer step."""

    def _apply_update(self, batch: int) -> None:
        trainer = self.lightning_module.trainer
        shared = [(param, group) for param, group, _, _ in self._shared]
        defer = self._defers_shared_sums(trainer)
        with self._collectives(batch):
            gradients.average_over_replicas(self._local_params, self.groups.replica, self.data_parallel_size)
            if defer:
                sums = gradients.launch_shared_sums(shared)
            else:
                gradients.sum_shared(shared)
        if not self._gradients_finite(batch):
            self.ledger.take_hparams(batch)
            self._zero_grad()
            return
        for optimizer in self.optimizers:
            before_optimizer_step_hooks(trainer, optimizer)
        with self._collectives(batch) if self.clip_mode == "global" else nullcontext():
            self._clip_gradients(trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
        hparams = self.ledger.take_hparams(batch)
        correction = self._correction if self.mode == "2bw" else None
        with ExitStack() as stack:
            if defer:  # the tied parameters' update later uses what this step used, after every pre-hook
                deferred_hparams: list[Any] = [[] for _ in self.optimizers]
                self.ledger.defer(batch, sums, deferred_hparams)
                for index, optimizer in enumerate(self.optimizers):
                    record = deferred_hparams.__setitem__
                    handle = optimizer.register_step_pre_hook(
                        lambda opt, *_, i=index, r=record: r(i, _hyperparameters(opt))
                    )
                    stack.callback(handle.remove)
            self._step_optimizers(hparams, post_hooks=correction is None)
        if correction is not None:
            versions = self.executor.versions
            before = versions.weights_of(versions.latest - 1)
            if defer:  # the tied parameters are corrected with their deferred update
                deferred = {id(param) for param, _ in shared}
                moved = [(p, w) for p, w in zip(self._local_params, before, strict=True) if id(p) not in deferred]
                correction.apply([w for _, w in moved], stale=batch >= 1, parameters=[p for p, _ in moved])
            else:
                correction.apply(before, stale=batch >= 1)
            for optimizer in self.optimizers:
                run_post_hooks(optimizer)
        self._zero_grad()

    def _zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def _gradients_finite(self, batch: int) -> bool:
        """The non-finite policy: ``stop`` raises on the stage that sees it; ``skip`` agrees over the pipeline
        (replicas already hold the same averaged gradients) and every stage skips batch ``batch``'s update."""
        if self.on_nonfinite == "stop":
            self._finite_watch.push(self._batch_step(batch), self._local_params)
            self.raise_if_nonfinite()
            return True
        # skip: the decision is needed before this update (the one host sync per update of this policy)
        flag = gradients.nonfinite_flag(self._local_params, self.root_device)
        with self._collectives(batch):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.groups.pipeline)
        if flag.item() == 0:
            return True
        self.skipped_updates.append(self._batch_step(batch))
        rank_zero_info(
            f"pd2bw: non-finite gradients in the batch of step {self._batch_step(batch)}: its update is skipped on "
            f"every stage ({len(self.skipped_updates)} skipped so far)"
        )
        return False

    def raise_if_nonfinite(self, wait: bool = False) -> None:
        """``stop``: raise for the first update whose gradients were non-finite, once its flags are on the host
        (``wait=True``: wait for every pending one, e.g. before a drain's checkpoint or the end of training)."""
        found = self._finite_watch.poll(wait)
        if found is None:
            return
        step, bad = found
        names = self._parameter_names()
        shown = [names.get(id(p), ["?"])[0] for p in bad]
        raise FloatingPointError(
            f"non-finite gradients in the batch of step {step} on {self._describe_rank(self.global_rank)}"
            f" (e.g. {', '.join(shown[:3])}). Lower the learning rate or clip gradients (trainer.gradient_clip_val), "
            "check the data, or let the pipeline skip such updates: PipeDream2BWStrategy(on_nonfinite='skip')"
        )

    def _batch_step(self, batch: int) -> int:
        """The Lightning step (global_step) that fed batch ``batch`` of this run segment."""
        return self.ledger.global_step(batch)

    def _step_optimizers(
        self, hparams: list[list[dict[str, Any]]], hooks: bool = True, post_hooks: bool = True
    ) -> None:
        """``step()`` of every optimizer with a batch's hyper-parameters (its Lightning step's learning rates);
        ``hooks=False`` completes an update whose step hooks already ran (a deferred tied parameter);
        ``post_hooks=False`` leaves the post-hooks to the caller (they run after the delay correction)."""
        for optimizer, values in zip(self.optimizers, hparams, strict=True):
            current = _hyperparameters(optimizer)
            for group, saved in zip(optimizer.param_groups, values):
                group.update(saved)
            try:
                with optimizer_hooks_suspended(optimizer, pre=not hooks, post=not (hooks and post_hooks)):
                    optimizer.step()
            finally:
                for group, saved in zip(optimizer.param_groups, current):
                    group.update(saved)

    def _defers_shared_sums(self, trainer: pl.Trainer) -> bool:
        """2BW without clipping (a clip norm needs the summed gradients at once) and not draining."""
        return (
            self.mode == "2bw"
            and bool(self._shared)
            and not trainer.gradient_clip_val
            and not self._draining
            and self.on_nonfinite != "skip"  # the skip decision needs the summed tied gradients at once
        )

    def _finish_deferred(self, until_batch: int) -> None:
        """Apply the deferred tied-parameter updates of batches <= ``until_batch`` to the newest weights.

        Called before batch ``until_batch + 2``'s first forward: the newest version is then the one
        that batch's update made, not yet read by anyone; every other gradient is left untouched.
        """
        for batch in self.ledger.deferred_until(until_batch):
            recorder = self.executor.recorder
            start = recorder.now() if recorder is not None else 0.0
            entries, deferred_hparams = self.ledger.take_deferred(batch)
            sums = gradients.finish_shared_sums(entries)
            self.executor.versions.use_latest()
            others = [(p, p.grad) for p in self._local_params]
            for param in self._local_params:
                param.grad = None
            for param, grad in sums:
                param.grad = grad
            before = [param.detach().clone() for param, _ in sums] if self._correction is not None else []
            self._step_optimizers(deferred_hparams, hooks=False)
            if self._correction is not None:
                self._correction.apply(before, stale=batch >= 1, parameters=[param for param, _ in sums])
            for param, grad in others:
                param.grad = grad
            if recorder is not None:
                recorder.add(SHARED_STEP, batch, -1, -1, start)

    def _collectives(self, batch: int) -> Any:
        """Marks gradient collectives inside an update on the timeline (when one is recorded)."""
        recorder = self.executor.recorder
        return recorder.span(REDUCE, batch) if recorder is not None else nullcontext()

    def _clip_gradients(self, clip_val: float | None, algorithm: Any) -> None:
        if not clip_val:
            return
        if str(getattr(algorithm, "value", algorithm)) == "value":
            torch.nn.utils.clip_grad_value_(self._local_params, clip_val)
            return
        not_counted = {id(p) for p, _, _, counts in self._shared if not counts}
        group = self.groups.pipeline if self.clip_mode == "global" else None
        gradients.clip_by_norm(self._local_params, clip_val, not_counted, group, self.root_device)
