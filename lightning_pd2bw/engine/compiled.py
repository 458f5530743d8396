"""``torch.compile`` for a stage's layers, per layer (as torchtitan compiles per transformer block), and a count of
the graphs it builds.

Each layer keeps its identity, its parameter names and its hooks: the layer's ``__call__`` is compiled in place
(what ``nn.Module.compile`` does), through a small function defined here, so that layers whose code lives in
``torch.nn`` (``nn.Sequential``, ``nn.TransformerEncoderLayer``, which dynamo would skip as library code) are
compiled too. Layers of the same class share their compiled code: the parameters are graph inputs, not constants.

2BW's weight versions swap ``p.data`` between storages of one shape, dtype and stride: no guard sees it, so the
swaps compile nothing (the test in ``tests/distributed/test_compile.py`` counts 0 graphs after warm-up over
version swaps, drains and evaluation). What does compile a graph once per phase: grad mode (evaluation and
prediction run under ``no_grad``), autocast (``bf16-mixed``), and a new input shape (a smaller last batch:
dynamo then marks the batch dimension dynamic and compiles once more).
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile modes that record CUDA graphs


def compile_options(value: bool | Mapping[str, Any] | None, mode: str, where: str = "compile") -> dict | None:
    """``False``/``None``: no compilation; ``True``: ``torch.compile``'s defaults; a mapping: its keyword arguments
    (``backend``, ``mode``, ``fullgraph``, ``dynamic``, ``options``), checked here by name."""
    if value is None or value is False:
        return None
    if mode == "zb_h1":
        raise ValueError(
            f"{where}: mode='zb_h1' splits each backward into the input gradient (B) and the deferred weight gradients "
            "(W) by intercepting the layers' linear maps, which a compiled layer hides (torch's zero-bubble schedules "
            "refuse torch.compile for the same reason). Train zb_h1 without compile, or compile under mode='flush'"
        )
    if value is True:
        return {}
    if not isinstance(value, Mapping):
        raise ValueError(
            f"{where}={value!r} is invalid; valid: false, true (torch.compile's defaults) or a mapping of "
            "torch.compile's keyword arguments, e.g. {'mode': 'max-autotune-no-cudagraphs'}"
        )
    options = _plain(value)
    allowed = [name for name in inspect.signature(torch.compile).parameters if name != "model"]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"{where} has unknown key(s) {unknown}; torch.compile takes {', '.join(allowed)}")
    if mode == "2bw" and options.get("mode") in CUDA_GRAPH_MODES:
        raise ValueError(
            f"{where}: mode={options['mode']!r} records CUDA graphs, which assume each parameter keeps its address; "
            "2BW points the parameters at two weight versions in turn, so the graphs would be re-recorded at every "
            "swap. Use mode='max-autotune-no-cudagraphs' (or the default) with mode='2bw', or train with "
            "mode='flush'"
        )
    return options


def _plain(value: Any) -> Any:
    """A Hydra ``DictConfig`` (or any mapping) as plain dicts, so that torch.compile sees builtin values."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def compile_layers(layers: Sequence[nn.Module], options: Mapping[str, Any]) -> None:
    """Compile each layer's ``__call__`` in place (hooks included; names and ``state_dict`` keys unchanged)."""
    hide = not fake_tensors_take_mixed_grads()
    for layer in layers:
        # nn.Module.compile() sets this attribute to torch.compile(self._call_impl); compiling a function of ours
        # instead makes dynamo trace modules defined in torch.nn as well (it skips library frames it is handed)
        compiled = torch.compile(_caller_of(layer), **options)
        layer._compiled_call_impl = _hiding_mixed_grads(layer, compiled) if hide else compiled


@functools.cache
def fake_tensors_take_mixed_grads() -> bool:
    """Whether dynamo can trace a parameter whose ``.grad`` has another dtype (a float32 gradient on a bfloat16
    weight version, ``grad_dtype=None``). torch 2.11 (an H200) and 2.13 cannot: their fake-tensor converter assigns the gradient before
    it copies ``grad_dtype`` and raises "attempting to assign a gradient with dtype 'float'"."""
    if not hasattr(torch.Tensor, "grad_dtype"):
        return True  # torch < 2.10: a gradient of another dtype cannot be attached at all
    param = nn.Parameter(torch.zeros(1, dtype=torch.bfloat16))
    param.grad_dtype = None
    param.grad = torch.zeros(1)
    try:
        with FakeTensorMode() as mode:
            mode.from_tensor(param)
    except RuntimeError:
        return False
    return True


def _hiding_mixed_grads(layer: nn.Module, compiled: Any) -> Any:
    """``compiled`` called with the float32 gradients of ``layer``'s bfloat16 parameters detached, and attached
    again after it (the same tensors: the accumulation into them runs later, in autograd's own nodes, outside
    the graph). Dynamo then traces what it can: parameters with no gradient."""
    params = list(layer.parameters())

    def call(*args: Any, **kwargs: Any) -> Any:
        hidden = [(p, p.grad) for p in params if p.grad is not None and p.grad.dtype != p.dtype]
        for param, _ in hidden:
            param.grad = None
        try:
            return compiled(*args, **kwargs)
        finally:
            for param, grad in hidden:
                param.grad = grad

    return call


def _call_layer(*args: Any, _call: Any = None, **kwargs: Any) -> Any:
    return _call(*args, **kwargs)


_CODES: dict[type, Any] = {}


def _caller_of(layer: nn.Module) -> Any:
    """``_call_layer`` bound to ``layer``, with one code object per layer class. Dynamo keeps its compiled graphs,
    and its limit on recompilations (8), per code object: layers of one class share their graphs (the parameters
    are inputs), and each class has the limit to itself (one shared code object would spend it on the classes'
    grad-mode and autocast variants, then run the rest eagerly)."""
    cls = type(layer)
    if cls not in _CODES:
        name = f"compiled_{cls.__name__}"
        _CODES[cls] = _call_layer.__code__.replace(co_name=name, co_qualname=name)
    caller = types.FunctionType(_CODES[cls], _call_layer.__globals__, _CODES[cls].co_name)
    caller.__kwdefaults__ = {"_call": layer._call_impl}
    return caller


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far (every recompilation is one more)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


class CompileMeter:
    """Counts the graphs compiled during the engine's phases, and those compiled after warm-up.

    Warm-up is each phase's first run: training's first two batches (2BW: the first with one weight version and the
    first with two), the first drain, the first evaluation run (consecutive ``evaluate`` calls) and the first
    prediction run. A graph compiled later is a recompilation a user pays for at every such event."""

    WARMUP_BATCHES = 2

    def __init__(self) -> None:
        self._start = graphs_compiled()
        self.recompiles_after_warmup = 0
        self._runs: dict[str, int] = {}  # phase -> runs begun
        self._batches = 0
        self._last: str | None = None

    @property
    def graphs(self) -> int:
        return graphs_compiled() - self._start

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """``train`` (one batch), ``drain``, ``evaluate`` or ``predict`` (one call each)."""
        if name != self._last:
            self._runs[name] = self._runs.get(name, 0) + 1
        self._last = name
        if name == "train":
            self._batches += 1
            warm = self._batches <= self.WARMUP_BATCHES
        else:
            warm = self._runs[name] == 1
        before = graphs_compiled()
        try:
            yield
        finally:
            if not warm:
                self.recompiles_after_warmup += graphs_compiled() - before

    def counters(self) -> dict[str, int]:
        return {"compile/graphs": self.graphs, "compile/recompiles_after_warmup": self.recompiles_after_warmup}
