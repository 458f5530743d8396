"""The split backward of the zero-bubble schedules: B computes a microbatch's input gradients, W its deferred weight
gradients (``Mode.splits_backward``; the schedule places W: ``schedule._split_order``).

What is deferred is what is cheap and exact to defer: every ``torch.nn.functional.linear`` (so every ``nn.Linear``,
a tied output projection, the project's blocks) whose weight is a trainable parameter, intercepted during the
stage's forward by a ``TorchFunctionMode``. In B its input gradient ``g W`` is computed and its input ``x`` and output
gradient ``g`` are kept; in W ``dW = g^T x`` and ``db = sum g`` are computed from them, as Megatron-LM's zero-bubble
integration does with its weight-gradient store. W hands them to autograd (one node over the microbatch's
parameters), so they accumulate into the same ``.grad`` (the gradient buckets' views) through the same
``AccumulateGrad`` as an undivided backward: the buckets' hooks, gradient hooks (the sparsity masks) and mixed
weights see them as before. Every other parameter's gradient is computed in B: the schedule stays exact, the split
only shrinks the bubble by the share it covers. Layers run under activation recomputation are not intercepted (their
recomputation in B would not match), nor are compiled layers (the engine refuses ``compile`` with a split).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode


class _DeferredLinear(torch.autograd.Function):
    """``F.linear`` whose backward returns the input gradient and keeps ``(weight, bias, x, g)`` for W."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kept: list) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):  # what autocast would run F.linear in: cast here, keep the casts
            dtype = torch.get_autocast_dtype(x.device.type)
            cast = (x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
            with torch.autocast(x.device.type, enabled=False):
                out = F.linear(*cast)
        else:
            cast = (x, weight, bias)
            out = F.linear(x, weight, bias)
        ctx.save_for_backward(cast[0], cast[1])
        ctx.weight, ctx.bias, ctx.kept, ctx.x_dtype = weight, bias, kept, x.dtype
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple:
        x, cast_weight = ctx.saved_tensors
        if g.dtype != cast_weight.dtype:
            g = g.to(cast_weight.dtype)
        # detached, and the node let go of the list: a kept input's grad_fn leads back through the graph to the nodes
        # that hold the list, a cycle through autograd's C++ nodes that Python's collector cannot free (a leak of
        # every microbatch's kept tensors, found by benchmarks/schedules.py)
        ctx.kept.append((ctx.weight, ctx.bias, x.detach(), g.detach()))
        ctx.kept = ctx.weight = ctx.bias = None
        grad_x = None
        if ctx.needs_input_grad[0]:  # one 2-D GEMM over the rows, as autograd's own linear backward runs it
            grad_x = g.reshape(-1, g.shape[-1]).mm(cast_weight).view(*g.shape[:-1], cast_weight.shape[1])
            grad_x = grad_x if grad_x.dtype == ctx.x_dtype else grad_x.to(ctx.x_dtype)
        return grad_x, None, None, None


class _WeightGradients(torch.autograd.Function):
    """One autograd node over a microbatch's deferred parameters: its backward is their ``dW = g^T x``, ``db``."""

    @staticmethod
    def forward(ctx: Any, kept: list, *params: torch.Tensor) -> torch.Tensor:
        ctx.kept, ctx.params = kept, params
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple:
        sums: dict[int, torch.Tensor] = {}
        for weight, bias, x, g in ctx.kept:
            rows = g.reshape(-1, g.shape[-1])
            if weight.requires_grad:
                _add(sums, weight, rows.t().matmul(x.reshape(-1, x.shape[-1])))
            if bias is not None and bias.requires_grad:
                _add(sums, bias, rows.sum(0))
        grads = tuple(sums.get(id(p)) for p in ctx.params)
        ctx.kept = ctx.params = None
        return (None, *grads)


def _add(sums: dict[int, torch.Tensor], param: torch.Tensor, value: torch.Tensor) -> None:
    sums[id(param)] = value if id(param) not in sums else sums[id(param)] + value


class WeightGradients:
    """A stage's deferred weight gradients, per microbatch: ``intercept(k)`` around the microbatch's forward, its B
    as usual, then ``compute(k)`` (the W action). ``pending_bytes``: what the kept inputs and output gradients hold."""

    def __init__(self) -> None:
        self._kept: dict[int, list] = {}
        self.pending_bytes = 0
        self.peak_bytes = 0

    def intercept(self, microbatch: int) -> TorchFunctionMode:
        """The mode that defers the linear maps of ``microbatch``'s forward."""
        return _Intercept(self._kept.setdefault(microbatch, []))

    def after_backward(self, microbatch: int) -> None:
        """B is done: count what W keeps."""
        held = sum(x.nbytes + g.nbytes for _, _, x, g in self._kept.get(microbatch, ()))
        self.pending_bytes += held
        self.peak_bytes = max(self.peak_bytes, self.pending_bytes)

    def compute(self, microbatch: int) -> None:
        """W: the microbatch's weight gradients, accumulated into the parameters' ``.grad`` through autograd."""
        kept = self._kept.pop(microbatch, [])
        self.pending_bytes -= sum(x.nbytes + g.nbytes for _, _, x, g in kept)
        params: dict[int, nn.Parameter] = {}
        for weight, bias, _, _ in kept:
            for param in (weight, bias):
                if param is not None and param.requires_grad:
                    params.setdefault(id(param), param)
        if params:
            _WeightGradients.apply(kept, *params.values()).backward()

    @property
    def in_flight(self) -> bool:
        return bool(self._kept)


class _Intercept(TorchFunctionMode):
    def __init__(self, kept: list) -> None:
        super().__init__()
        self.kept = kept

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            x = args[0] if args else kwargs["input"]
            weight = args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if isinstance(weight, nn.Parameter) and weight.requires_grad and weight.layout == torch.strided:
                return _DeferredLinear.apply(x, weight, bias, self.kept)
        return func(*args, **kwargs)
