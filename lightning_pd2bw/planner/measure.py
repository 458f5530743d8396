"""Profiles measured on the real device: each layer timed alone, forward and backward.

Layers are profiled one at a time in pipeline order (layer i's input is layer i-1's output), so a
model that only fits across many devices can still be profiled on one: a layer on the meta device
is copied, materialised, profiled and dropped. Identical layers (same type, parameter shapes and
input shape: a transformer's blocks) are measured once. Activation bytes are what autograd saves
for the backward (unique storages, parameters excluded), which is what a stash keeps alive.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..engine.comm.transport import as_tuple, wire_bytes
from ..engine.materialize import materialize
from ..engine.weight_grads import WeightGradients
from ..observe.activations import ActivationMeter
from .profile import LayerProfile


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in as_tuple(value) if isinstance(t, torch.Tensor))


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (GPU kernels and NCCL calls return before they finish)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> tuple[float, Any]:
    """Median seconds of ``fn`` over ``repeats`` runs after one warm-up, and its last result."""
    result = fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        result = fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def _backward_of(out: Any, loss: torch.Tensor | None) -> None:
    """The backward a layer's timing runs: its loss's on the last layer, else ones into every output."""
    if loss is not None:
        loss.backward()
    else:
        tensors = [t for t in as_tuple(out) if t.requires_grad]
        torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])


def _weight_grad_seconds(forward: Callable[[], tuple[Any, Any]], device: torch.device, repeats: int) -> float:
    """Median seconds of a split backward's W for one microbatch (``engine/weight_grads.py``: the layer's linear
    maps' weight gradients, deferred from its B): what ``zb_h1`` moves into the bubble (0 where nothing is deferred)."""
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        store = WeightGradients()
        with store.intercept(0):
            out, loss = forward()
        _backward_of(out, loss)  # B, as the executor runs it: outside the interception
        synchronize(device)
        start = time.perf_counter()
        store.compute(0)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _signature(layer: nn.Module, inputs: tuple) -> tuple:
    params = tuple((name, tuple(p.shape), p.dtype) for name, p in layer.named_parameters())
    shapes = tuple(tuple(t.shape) for t in inputs if isinstance(t, torch.Tensor))
    return type(layer).__name__, params, shapes


def _initialise(layer: nn.Module) -> None:
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if "norm" in name or name.endswith(("ln.weight", "ln_1.weight", "ln_2.weight", "ln_f.weight")):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)


def _in_dtype(layer: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """``layer`` itself, or a copy whose floating-point parameters are in ``dtype`` (buffers unchanged)."""
    if dtype is None:
        return layer
    copied = copy.deepcopy(layer)
    for param in copied.parameters():
        if param.is_floating_point():
            param.data = param.data.to(dtype)
    return copied


def measure_layers(
    layers: Sequence[nn.Module],
    first_input: Any,
    device: torch.device,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
    repeats: int = 3,
    autocast: Callable[[], Any] | None = None,
    weight_dtype: torch.dtype | None = None,
    boundary_dtype: torch.dtype | None = None,
) -> list[LayerProfile]:
    """Profile ``layers`` on ``device`` for one microbatch whose first-layer input is ``first_input``.

    ``loss_fn(output)`` (the last layer's output to a scalar) is timed as part of the last layer,
    as in the pipeline. ``optimizer(params)`` builds the optimizer whose step is timed per layer
    (default AdamW). ``weight_dtype`` (``PipelineOptions.weight_dtype``, resolved): the forward and backward run
    on a copy of the weights in that dtype, as the pipeline's versions are (no cast per microbatch, none kept for
    the backward); the optimizer steps the float32 weights. ``boundary_dtype`` (resolved): what floating outputs
    cross stages in (each profile's ``output_bytes``; ``kept_output_bytes`` is the output in its own dtype).
    """
    optimizer = optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-4))
    autocast = autocast or (lambda: torch.autocast(device.type, enabled=False))
    inputs = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in as_tuple(first_input))
    cache: dict[tuple, LayerProfile] = {}
    profiles = []
    for index, original in enumerate(layers):
        is_last = index == len(layers) - 1
        on_meta = any(p.is_meta for p in original.parameters())
        layer = copy.deepcopy(original)  # the optimizer step must not touch the real weights
        if on_meta:
            materialize([layer], device)
            _initialise(layer)
        key = (*_signature(layer, inputs), is_last)
        params = list(dict.fromkeys(p for p in layer.parameters() if p.requires_grad))  # what the optimizer steps
        compute = _in_dtype(layer, weight_dtype)  # what the forward and backward run on

        def forward(layer=compute, is_last=is_last, inputs=inputs) -> tuple[Any, Any]:
            leaf = tuple(t.detach().requires_grad_() if t.is_floating_point() else t for t in inputs)
            with autocast():
                out = layer(*leaf)
                loss = loss_fn(out) if is_last and loss_fn is not None else None
            return out, loss

        if key in cache:
            profile = cache[key]
            with torch.no_grad(), autocast():
                output = compute(*inputs)
        else:
            forward_s, (output, _) = _timed(forward, device, repeats)
            meter = ActivationMeter([*params, *compute.parameters()])
            with meter.hooks():
                out, loss = forward()
            saved = meter.current

            both_s, _ = _timed(lambda forward=forward: _backward_of(*forward()), device, repeats)
            weight_grad_s = _weight_grad_seconds(forward, device, repeats)
            step_s = 0.0
            if params:
                for p in params:
                    p.grad = torch.randn_like(p) * 1e-3
                opt = optimizer(params)
                step_s, _ = _timed(opt.step, device, repeats)
                del opt
            for p in params:
                p.grad = None
            profile = LayerProfile(
                forward_s=forward_s,
                backward_s=max(both_s - forward_s, 0.0),
                activation_bytes=float(saved),
                output_bytes=0.0 if is_last else float(wire_bytes(output, boundary_dtype)),  # as it crosses
                kept_output_bytes=0.0 if is_last else float(_nbytes(output)),
                parameters=sum(p.numel() for p in params),
                optimizer_s=step_s,
                weight_grad_s=weight_grad_s,
            )
            cache[key] = profile
            del out, loss
        profiles.append(profile)
        inputs = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in as_tuple(output))
        if on_meta:
            del layer
    return profiles
