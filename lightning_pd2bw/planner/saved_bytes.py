"""Activation bytes from the model itself: what autograd keeps for each layer's backward, counted, not modelled.

Each distinct layer runs once at the run's true shapes, precision and weight dtype under ``FakeTensorMode``:
every tensor is a shape and a dtype, nothing is allocated, and a 13B model's layers take milliseconds each. The
``saved_tensors_hooks`` see exactly what the real forward would save (the same kernels are chosen: fake tensors
sit on the CPU device, where ``scaled_dot_product_attention`` runs the flash kernel that keeps its output and the
log-sum-exp, as CUDA's flash and efficient kernels do, never the attention scores). Each storage counts once
(views of one activation share it); parameters are not counted, the layer's input is (the stash keeps it).

Why not a formula: Korthikanti et al.'s ``s*b*h*(34 + 5*a*s/h)`` counts the scores, softmax and dropout masks of an
unfused attention. With SDPA a GPT block keeps 16 ``s*b*h`` elements (``tests/unit/test_saved_bytes.py`` checks the
count against a real CPU forward for GPT, BERT and a Hugging Face block); the formula said 3.5x that at 13B's shapes.

With recomputation (``recompute=True``) a layer keeps only its input for the backward; its full activations exist
for one microbatch at a time while it is rebuilt (the planner's ``largest_layer`` term).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

from ..engine.comm.transport import as_tuple, wire_bytes


@dataclass(frozen=True)
class LayerBytes:
    saved: int  # kept for the backward of one microbatch, the layer's input included
    output: int  # the layer's output in its own dtype (what a stage keeps of it for its backward)
    input: int  # the layer's floating-point input (what a recomputed layer keeps)
    sent: int = 0  # the output as it crosses to the next stage when a cut follows it (``boundary_dtype``)


def storage_key(tensor: torch.Tensor) -> int:
    """The identity of ``tensor``'s storage, for real and fake tensors alike (a fake one has no data pointer)."""
    return tensor.untyped_storage()._cdata


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in as_tuple(value) if isinstance(t, torch.Tensor))


class SavedBytes:
    """Counts the unique storages autograd saves inside ``with counter:``, parameters excluded."""

    def __init__(self, parameters: Sequence[torch.Tensor]) -> None:
        self._parameters = {storage_key(p) for p in parameters}
        self._seen: dict[int, int] = {}

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = storage_key(tensor)
        if key not in self._parameters:
            self._seen[key] = tensor.untyped_storage().nbytes()
        return tensor

    def __enter__(self) -> SavedBytes:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self._seen.values())


# CUDA autocast's op lists (torch's "Autocast Op Reference"): what runs in the low-precision dtype and what in float32.
# The CPU's autocast has other lists (layer_norm stays in the input's dtype there), and CUDA cannot be faked
# without a CUDA build, so the count runs CUDA's policy itself over fake CPU tensors (``CudaAutocastPolicy``).
LOW_PRECISION_OPS = frozenset(
    "linear matmul __matmul__ mm bmm baddbmm addmm addbmm addmv addr mv conv1d conv2d conv3d conv_transpose1d "
    "conv_transpose2d conv_transpose3d prelu scaled_dot_product_attention chain_matmul multi_dot".split()
)
FLOAT32_OPS = frozenset(
    "layer_norm group_norm norm normalize softmax log_softmax softmin softplus cross_entropy nll_loss "
    "binary_cross_entropy_with_logits mse_loss l1_loss smooth_l1_loss kl_div cumsum cumprod sum prod exp expm1 log "
    "log1p log2 log10 pow rsqrt reciprocal acos asin cosh sinh tan erfinv cdist pdist cosine_similarity dist "
    "renorm __pow__ __rpow__ __rdiv__ __rtruediv__".split()
)


class CudaAutocastPolicy(TorchFunctionMode):
    """``torch.autocast("cuda", dtype)``'s casts on any device: the low-precision ops get their floating-point
    tensors in ``dtype``, the float32 ops in float32, the rest run as given (type promotion widens mixed inputs)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        target = self.dtype if name in LOW_PRECISION_OPS else torch.float32 if name in FLOAT32_OPS else None
        kwargs = kwargs or {}
        if target is not None:
            args, kwargs = _cast((args, kwargs), target)
        return func(*args, **kwargs)


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != torch.float64 else value
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast(v, dtype) for k, v in value.items()}
    return value


def _signature(layer: nn.Module, inputs: tuple, weight_dtype: torch.dtype | None = None) -> tuple:
    """What a layer's counts follow from: its type, its parameters' shapes and dtypes (floating ones in
    ``weight_dtype``, as ``_meta_copy`` makes them), its inputs' shapes and dtypes."""
    params = tuple(
        (name, tuple(p.shape), weight_dtype if weight_dtype is not None and p.is_floating_point() else p.dtype)
        for name, p in layer.named_parameters()
    )
    shapes = tuple((tuple(t.shape), t.dtype) for t in inputs if isinstance(t, torch.Tensor))
    return type(layer).__name__, params, shapes


def _leaves(inputs: tuple) -> tuple:
    """The layer's inputs as the pipeline hands them over: floating-point ones are leaves that need a gradient."""
    return tuple(
        t.detach().requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs
    )


def count_layers(
    layers: Sequence[nn.Module],
    first_input: Any,
    *,
    weight_dtype: torch.dtype | None = None,
    autocast_dtype: torch.dtype | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    fake: bool = True,
    boundary_dtype: torch.dtype | None = None,
) -> list[LayerBytes]:
    """``LayerBytes`` of every layer, in pipeline order (layer i's input is layer i-1's output).

    ``first_input``: layer 0's input for one microbatch (real or meta tensors: only shapes and dtypes are read when
    ``fake``). ``weight_dtype``: the dtype the forward's weights are in (the pipeline's bf16 versions), None: as
    built. ``autocast_dtype``: the precision plugin's autocast (``bf16-mixed``) with CUDA's op lists
    (``CudaAutocastPolicy``: the GPU the plan is for, also where the tensors are real CPU ones), None: off. ``loss_fn(output)``:
    the last layer's loss, counted with it as the pipeline runs it. ``boundary_dtype``: what floating outputs cross
    in (the run's resolved ``boundary_dtype``; None: their own). ``fake=False`` runs the real layers (a
    reference for tests; the layers must then be materialised)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else nullcontext()
    cache: dict[tuple, LayerBytes] = {}
    outputs: dict[tuple, Any] = {}  # fake: a counted layer's output, the next layer's input where the same layer recurs
    counted: list[LayerBytes] = []
    with mode:
        inputs = tuple(_as_fake(t) if fake else t for t in as_tuple(first_input))
    for index, original in enumerate(layers):
        is_last = index == len(layers) - 1
        key = (*_signature(original, inputs, weight_dtype), is_last)
        if fake and key in outputs:  # a repeated block: its counts and its output's shapes are the first one's
            counted.append(cache[key])
            inputs = outputs[key]
            continue
        layer = _meta_copy(original, weight_dtype) if fake else original
        with mode:
            if fake:
                layer = layer.to_empty(device="cpu")
            autocast = CudaAutocastPolicy(autocast_dtype) if autocast_dtype else nullcontext()
            leaves = _leaves(inputs)
            if key in cache:
                with torch.no_grad(), autocast:
                    output = layer(*leaves)
            else:
                with SavedBytes(list(layer.parameters())) as counter, autocast:
                    output = layer(*leaves)
                    if is_last and loss_fn is not None:
                        loss_fn(output)
                cache[key] = LayerBytes(
                    saved=counter.total,
                    output=0 if is_last else _nbytes(output),
                    sent=0 if is_last else wire_bytes(output, boundary_dtype),
                    input=_nbytes(tuple(t for t in inputs if isinstance(t, torch.Tensor) and t.is_floating_point())),
                )
            counted.append(cache[key])
            inputs = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in as_tuple(output))
            outputs[key] = inputs
    return counted


def _as_fake(tensor: Any) -> Any:
    """A tensor of ``tensor``'s shape and dtype on the CPU (inside ``FakeTensorMode``: nothing allocated)."""
    if not isinstance(tensor, torch.Tensor):
        return tensor
    return torch.zeros(tensor.shape, dtype=tensor.dtype)


def _meta_copy(layer: nn.Module, weight_dtype: torch.dtype | None) -> nn.Module:
    """A copy of ``layer`` on the meta device (to be made fake CPU tensors), weights in ``weight_dtype``."""
    copied = copy.deepcopy(layer)
    if not _on_meta(copied):
        copied = copied.to("meta")  # the copy's storages go; only shapes and dtypes are read
    if weight_dtype is not None:
        for param in copied.parameters():  # the parameters alone, as the pipeline's weight versions
            if param.is_floating_point():
                param.data = param.data.to(weight_dtype)
    return copied


def _on_meta(layer: nn.Module) -> bool:
    tensors = [*layer.parameters(), *layer.buffers()]
    return bool(tensors) and all(t.is_meta for t in tensors)
