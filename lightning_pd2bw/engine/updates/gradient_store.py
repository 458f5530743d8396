"""Where a stage's gradients accumulate, and the one place that moves them at the update's begin: ``GradientStore``.

Every stage parameter's main gradient lives here: the replicated parameters' in the flat buckets
(``grad_buckets.py``: at width > 1, and at width 1 under mixed weights, where the buckets serve as the float32 main
gradients with no collective), a tied parameter's as its own tensor (float32 under mixed weights, attached before
the backward, so that autograd adds each microbatch's bfloat16 gradient into it, as into the buckets). Under mixed
weights ``versions.WeightVersions`` clears ``grad_dtype`` on every parameter so a float32 ``.grad`` may sit on a
bfloat16 version.

At REDUCE the store ``take``s the gradients outside the buckets out of ``.grad`` (the bucket reducer hands over the
buckets themselves); after STEP under flush and gpipe the one bucket set is zeroed and becomes the next batch's
(2BW's second set was attached when the first was handed over).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .grad_buckets import GradientBuckets


class GradientStore:
    """The gradients of ``params`` (this stage's own; ``tied``: ids of those several stages hold)."""

    def __init__(
        self, params: Sequence[nn.Parameter], tied: set[int], buckets: GradientBuckets | None, mixed: bool
    ) -> None:
        self.params = list(params)
        self.tied = [p for p in self.params if id(p) in tied]
        self.buckets = buckets  # the replicated (untied) parameters', when any
        self.mixed = mixed  # a float32 .grad on a bfloat16 version: ``WeightVersions`` allows it (``grad_dtype``)
        self._in_buckets = {id(p) for p in self.params if id(p) not in tied} if buckets is not None else set()

    @property
    def held_bytes(self) -> int:
        """The buckets' bytes (every set allocated); the tied and unbucketed gradients count as ``.grad``."""
        return self.buckets.held_bytes if self.buckets is not None else 0

    def attach(self) -> None:
        """Before a batch's compute: every gradient it accumulates into is in place (e.g. after Lightning's
        ``zero_grad`` set them to None)."""
        if self.buckets is not None:
            self.buckets.attach()
        self._attach_tied()

    def _attach_tied(self) -> None:
        if self.mixed:  # the parameters are on the master here: float32 gradients autograd adds into
            for param in self.tied:
                if param.grad is None:
                    param.grad = torch.zeros_like(param, dtype=torch.float32)  # (another's master: a version here)

    def take(self) -> list[torch.Tensor | None]:
        """REDUCE: the gradients outside the buckets, out of ``.grad`` (None at a bucketed parameter: its averaged
        view comes from the reducer), and the next batch's tied gradients attached."""
        grads: list[torch.Tensor | None] = []
        for param in self.params:
            if id(param) in self._in_buckets:
                grads.append(None)
                continue
            grads.append(param.grad)
            param.grad = None
        self._attach_tied()
        return grads

    def after_step(self, double_buffered: bool) -> None:
        """After STEP: flush and gpipe's one bucket set becomes the next batch's."""
        if self.buckets is not None and not double_buffered:
            self.buckets.zero()

    def close(self) -> None:
        if self.buckets is not None:
            self.buckets.close()
