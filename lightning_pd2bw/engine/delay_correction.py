"""Delay correction for 2BW's one-step-stale gradients (no Lightning here).

Under 2BW, update t applies the optimizer to the gradient of W(t-1), not of W(t). Let
``D(t) = optimizer step(W(t), grad f(W(t-1))) - W(t)`` be the update the optimizer makes (any optimizer:
SGD, AdamW, Muon, several at once; weight decay included). The synchronous update at t would have used
grad f(W(t)), which only arrives with update t+1; its update ``D(t+1)`` is what update t got wrong. The
error-feedback correction (Zmushko et al., 2026, arXiv 2606.30634: an optimizer-agnostic,
error-feedback-style correction of the one-step delay) adds that error, estimated from the last two
updates, back into the weights:

    W(t+1) = W(t) + D(t) + beta * (D(t) - D(t-1))

``beta = 1`` is a first-order extrapolation of the update one step ahead. The correction applies only to
updates whose gradient was stale: not to the first update after a drain (its gradient is of the newest
weights), and never under flush. Because the corrections telescope (their sum is
``beta * (D(last) - D(first))``), the weights travel the same total distance as without it; what changes is
when. Cost: one buffer the size of the stage's weights (``D(t-1)``), and one subtract, one subtract-scale-add
per update (``torch._foreach_*``, in place but for D(t)). It holds no state across a drain, so checkpoints need none.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

METHODS = ("error_feedback",)


class ErrorFeedback:
    """``W(t+1) = W(t) + D(t) + beta (D(t) - D(t-1))`` on a stage's parameters, each with its own D(t-1).

    The rule is per parameter, so a parameter may be updated apart from the others (2BW's deferred tied
    parameters): ``apply`` takes the parameters one update moved, by default all of them.
    """

    def __init__(self, parameters: Sequence[torch.nn.Parameter], beta: float = 1.0) -> None:
        if beta <= 0:
            raise ValueError(f"delay correction strength beta={beta} must be > 0")
        self.parameters = list(parameters)
        self.beta = beta
        self.previous: dict[int, torch.Tensor] = {}  # id(parameter) -> D(t-1)

    @torch.no_grad()
    def apply(
        self,
        before: Sequence[torch.Tensor],
        stale: bool,
        parameters: Sequence[torch.nn.Parameter] | None = None,
    ) -> None:
        """After an update moved ``parameters`` from ``before`` (W(t)) to W(t) + D(t): add the correction
        when the update's gradient was ``stale``; remember D(t) either way."""
        parameters = self.parameters if parameters is None else list(parameters)
        weights = [p.data for p in parameters]
        delta = torch._foreach_sub(weights, list(before))
        if stale:
            pairs = [
                (w, d, self.previous[id(p)]) for p, w, d in zip(parameters, weights, delta) if id(p) in self.previous
            ]
            if pairs:
                moved, now, previous = (list(x) for x in zip(*pairs))
                torch._foreach_sub_(previous, now)  # D(t-1) - D(t), in the buffer about to be dropped
                torch._foreach_add_(moved, previous, alpha=-self.beta)
        self.previous.update((id(p), d) for p, d in zip(parameters, delta))

    @property
    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.previous.values())
