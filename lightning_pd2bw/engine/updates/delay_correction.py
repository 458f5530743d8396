"""Delay corrections for 2BW's one-step-stale gradients (no Lightning here).

Under 2BW, update t applies the optimizer to the gradient of W(t-1), not of W(t). Let
``D(t) = optimizer step(W(t), grad f(W(t-1))) - W(t)`` be the update the optimizer makes (any optimizer:
SGD, AdamW, Muon, several at once; weight decay included). The synchronous update at t would have used
grad f(W(t)), which only arrives with update t+1; its update ``D(t+1)`` is what update t got wrong.

``error_feedback`` (Zmushko et al., 2026, arXiv 2606.30634: an optimizer-agnostic, error-feedback-style
correction of the one-step delay) adds that error, estimated from the last two updates, back into the weights:

    W(t+1) = W(t) + E(t),   E(t) = D(t) + beta * (D(t) - D(t-1))

``predictive_error_feedback`` also evaluates the gradient where the weights are about to be (PipeOptim, Guan et al.,
arXiv 2312.00839: weight prediction from the optimizer's own last step): the stored weights run one applied change
ahead, so the next batch's forward and backward read the prediction ``W(t+1) + E(t)`` instead of ``W(t+1)``. Kept
as the stored weights, the prediction needs no third weight version: the stored weights move by ``E`` corrected once
more, ``E(t) + beta * (E(t) - E(t-1))``, that is, with D(t-2) as the second buffer,

    V(t+1) = V(t) + (1+beta)^2 D(t) - 2 beta (1+beta) D(t-1) + beta^2 D(t-2)

(``beta = 1``: 4 D(t) - 4 D(t-1) + D(t-2)). The stored weights are what trains, validates and is saved; the
optimizer's decoupled weight decay applies to them (it differs from decaying the unpredicted weights by lr * wd
times one update, far below the update itself).

Both apply only to updates whose gradient was stale: not to the first update after a drain (its gradient is of the
newest weights; the history restarts there), and never under flush. Their coefficients sum to one, so over a run
the weights travel the same total distance as without a correction (the corrections telescope); what changes is
when. At a sparsity mask change (``restart``) the changed entries' history is forgotten: a weight dropped within the
last two updates and grown again restarts from zero, not from the correction of its old value. Cost per update: ``error_feedback`` holds D(t-1) (one buffer the size of the stage's weights) and makes three
weight-sized ``torch._foreach_*`` passes; ``predictive_error_feedback`` holds D(t-1) and D(t-2) (two buffers) and
makes four. Neither keeps state across a drain, so checkpoints need none.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

ORDERS = {"error_feedback": 1, "predictive_error_feedback": 2}  # method -> updates held (buffers of the weights)
METHODS = tuple(ORDERS)


def buffers(method: str | None) -> int:
    """Buffers the size of a stage's weights that ``method`` holds between updates (0: no correction)."""
    return ORDERS[method] if method is not None else 0


class ErrorFeedback:
    """The correction on a stage's parameters (``order`` 1: ``error_feedback``; 2: ``predictive_error_feedback``),
    each parameter with its own history of updates.

    The rule is per parameter, so a parameter may be updated apart from the others (2BW's deferred tied
    parameters): ``apply`` takes the parameters one update moved, by default all of them.
    """

    def __init__(self, parameters: Sequence[torch.nn.Parameter], beta: float = 1.0, order: int = 1) -> None:
        if beta <= 0:
            raise ValueError(f"delay correction strength beta={beta} must be > 0")
        if order not in (1, 2):
            raise ValueError(f"delay correction order={order} must be 1 or 2")
        self.parameters = list(parameters)
        self.beta = beta
        self.order = order
        self.previous: dict[int, torch.Tensor] = {}  # id(parameter) -> D(t-1)
        self.before_previous: dict[int, torch.Tensor] = {}  # id(parameter) -> D(t-2) (order 2)
        self._restarted: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (positions, values at restart)

    @classmethod
    def for_method(cls, method: str, parameters: Sequence[torch.nn.Parameter], beta: float = 1.0) -> ErrorFeedback:
        return cls(parameters, beta, ORDERS[method])

    @torch.no_grad()
    def restart(self, parameter: torch.nn.Parameter, positions: torch.Tensor) -> None:
        """Entries of ``parameter`` at ``positions`` (a bool mask) were set from outside the optimizer before this
        update's step (a sparsity mask changed: dropped weights zeroed, grown ones started at zero, SPDF's switch to
        dense): their history is forgotten (D(t-1), D(t-2) zeroed there) and this update's D(t) there counts from
        the values they have now, so a weight that becomes active again restarts from its new value, never from a
        correction of its old one."""
        key = id(parameter)
        if key not in {id(p) for p in self.parameters}:
            return
        for history in (self.previous, self.before_previous):
            if key in history:
                history[key].masked_fill_(positions.to(history[key].device), 0)
        self._restarted[key] = (positions, parameter.detach()[positions].clone())

    @torch.no_grad()
    def apply(
        self,
        before: Sequence[torch.Tensor],
        stale: bool,
        parameters: Sequence[torch.nn.Parameter] | None = None,
        scratch: bool = False,
    ) -> None:
        """After an update moved ``parameters`` from ``before`` (W(t)) to W(t) + D(t): add the correction
        when the update's gradient was ``stale``; remember D(t) either way (a fresh update restarts the history).
        ``scratch``: ``before`` is a copy of the caller's that becomes D(t) in place (no second buffer)."""
        parameters = self.parameters if parameters is None else list(parameters)
        if not parameters:  # a replica that owns none of its stage's tensors (the sharded optimizer at a wide width)
            return
        weights = [p.data for p in parameters]
        if scratch:
            delta = list(before)
            torch._foreach_sub_(delta, weights)
            torch._foreach_neg_(delta)  # W(t) - (W(t) + D(t)), negated: D(t), where the copy was
        else:
            delta = torch._foreach_sub(weights, list(before))
        for param, update, weight in zip(parameters, delta, weights):
            restarted = self._restarted.pop(id(param), None)
            if restarted is not None:  # D(t) from the values set at the restart, not from W(t) before it
                positions, values = restarted
                positions = positions.to(update.device)
                update[positions] = weight[positions] - values.to(update.device, update.dtype)
        if stale:
            if self.order == 1:
                self._first_order(parameters, weights, delta)
            else:
                self._second_order(parameters, weights, delta)
        for param, update in zip(parameters, delta):
            key = id(param)
            if stale and self.order == 2 and key in self.previous:
                self.before_previous[key] = self.previous[key]
            else:
                self.before_previous.pop(key, None)
            self.previous[key] = update

    def _first_order(self, parameters: list, weights: list, delta: list) -> None:
        """W += beta (D(t) - D(t-1)), computed in D(t-1)'s buffer, which is dropped next."""
        pairs = [(w, d, self.previous[id(p)]) for p, w, d in zip(parameters, weights, delta) if id(p) in self.previous]
        if pairs:
            moved, now, previous = (list(x) for x in zip(*pairs))
            torch._foreach_sub_(previous, now)  # D(t-1) - D(t)
            torch._foreach_add_(moved, previous, alpha=-self.beta)

    def _second_order(self, parameters: list, weights: list, delta: list) -> None:
        """W += a D(t) + b D(t-1) + c D(t-2) (W already holds + D(t)); without D(t-2) (the second update after a
        drain), D(t-1) stands in for it."""
        beta = self.beta
        a, b, c = beta * (2 + beta), -2 * beta * (1 + beta), beta * beta
        full = [
            (w, d, self.previous[id(p)], self.before_previous[id(p)])
            for p, w, d in zip(parameters, weights, delta)
            if id(p) in self.before_previous
        ]
        short = [
            (w, d, self.previous[id(p)])
            for p, w, d in zip(parameters, weights, delta)
            if id(p) in self.previous and id(p) not in self.before_previous
        ]
        if full:
            moved, now, previous, older = (list(x) for x in zip(*full))
            torch._foreach_add_(older, previous, alpha=b / c)  # c D(t-2) + b D(t-1), in D(t-2)'s buffer (dropped next)
            torch._foreach_add_(moved, now, alpha=a)
            torch._foreach_add_(moved, older, alpha=c)
        if short:
            moved, now, previous = (list(x) for x in zip(*short))
            torch._foreach_add_(moved, now, alpha=a)
            torch._foreach_add_(moved, previous, alpha=b + c)

    @property
    def held_bytes(self) -> int:
        held = [*self.previous.values(), *self.before_previous.values()]
        return sum(t.numel() * t.element_size() for t in held)
