"""Build a model without its weights, then give each stage its own layers, initialised or refused.

``parameters_on_meta`` is the context ``configure_model`` runs in: every parameter goes to the meta device as
it is registered (no memory, no initialisation cost), while buffers keep the values their constructor computed
(causal masks, rotary tables, position ids: small, and recomputing them is the model's business).
``materialize`` gives a stage's meta tensors real storage filled with a poison (NaN, or the dtype's minimum
for integers); ``initialize`` runs the model's own initialisation; ``unwritten`` names every tensor the
initialisation left poisoned, so a missing ``reset_parameters`` is an error at setup, never garbage weights.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence, Set
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within the context, a parameter moves to the meta device when a module registers it.

    A module that allocates ``torch.empty(...)`` for a weight pays no memory (the pages are never touched) and
    its ``reset_parameters`` runs on the meta tensor (free); buffers stay real.
    """
    original = nn.Module.register_parameter

    def register_on_meta(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(self, name, param)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def _poison(like: torch.Tensor, device: torch.device) -> torch.Tensor:
    if like.dtype.is_floating_point or like.dtype.is_complex:
        return torch.full_like(like, float("nan"), device=device)
    if like.dtype == torch.bool:
        return torch.zeros_like(like, device=device)
    return torch.full_like(like, torch.iinfo(like.dtype).min, device=device)


def materialize(layers: Sequence[nn.Module], device: torch.device) -> bool:
    """Give every meta parameter/buffer of ``layers`` real storage on ``device``, filled with a poison.

    A parameter referenced by several modules gets one new tensor, re-tied everywhere.
    Returns True when anything was on the meta device (the caller then initialises it).
    """
    replaced: dict[int, nn.Parameter] = {}
    found = False
    for layer in layers:
        for module in layer.modules():
            for name, param in list(module._parameters.items()):
                if param is None or not param.is_meta:
                    continue
                found = True
                if id(param) not in replaced:
                    replaced[id(param)] = nn.Parameter(_poison(param, device), param.requires_grad)
                setattr(module, name, replaced[id(param)])
            for name, buffer in list(module._buffers.items()):
                if buffer is not None and buffer.is_meta:
                    found = True
                    module._buffers[name] = _poison(buffer, device)
    return found


def post_order(module: nn.Module) -> Iterator[nn.Module]:
    """Children before their parent, as constructors run (a parent's init may overwrite its children's)."""
    for child in module.children():
        yield from post_order(child)
    yield module


def is_hugging_face(module: nn.Module) -> bool:
    """A ``transformers.PreTrainedModel``, by type (no module is one unless ``transformers`` was imported)."""
    transformers = sys.modules.get("transformers")
    pretrained = getattr(transformers, "PreTrainedModel", None) if transformers is not None else None
    return pretrained is not None and isinstance(module, pretrained)


def hf_owners(root: nn.Module) -> dict[int, nn.Module]:
    """id(module) -> the innermost Hugging Face ``PreTrainedModel`` holding it (its ``_init_weights`` initialises
    it)."""
    owners: dict[int, nn.Module] = {}
    for candidate in root.modules():  # outer models first: inner ones overwrite their own modules
        if is_hugging_face(candidate):
            owners.update((id(sub), candidate) for sub in candidate.modules())
    return owners


def init_weights_owners(root: nn.Module) -> list[nn.Module]:
    """The outermost modules (not Hugging Face's) with torchtitan's initialisation protocol, ``init_weights()``:
    what torchtitan calls once a model built on the meta device is materialised; it initialises every module
    under it (depth-scaled standard deviations, the output layer's own)."""
    found: list[nn.Module] = []
    covered: set[int] = set()
    for module in root.modules():  # pre-order: an owner before the modules it covers
        if id(module) in covered or is_hugging_face(module) or not callable(getattr(module, "init_weights", None)):
            continue
        found.append(module)
        covered |= {id(sub) for sub in module.modules()}
    return found


@torch.no_grad()
def run_init_weights(owner: nn.Module) -> None:
    """``owner.init_weights()``, with other stages' parameters as meta placeholders (initialising them is a no-op);
    refused by name when it cannot run on a partly materialised model."""
    try:
        owner.init_weights()
    except Exception as error:
        raise RuntimeError(
            f"pd2bw: {type(owner).__name__}.init_weights() (torchtitan's initialisation protocol) failed on this stage, "
            f"which holds only its own layers ({type(error).__name__}: {error}). Define init_pipeline_layer(self, "
            "index) on the LightningModule (PipelineEngine's init_layer=) to initialise layer `index` the way "
            "init_weights() does (docs/models.md, "
            "'Meta initialisation and the rules')"
        ) from error


@torch.no_grad()
def initialize(layer: nn.Module, owners: dict[int, nn.Module], skip: Set[int] = frozenset()) -> None:
    """The layer's modules, children first: a Hugging Face model's ``_init_weights`` for its own modules,
    ``reset_parameters`` (or torch's ``_reset_parameters``, e.g. ``nn.MultiheadAttention``) for the rest,
    the layer itself included; none of those in ``skip`` (an ``init_weights()`` owner initialises them)."""
    for module in post_order(layer):
        if id(module) in skip:
            continue
        owner = owners.get(id(module))
        if owner is not None:
            owner._init_weights(module)
            continue
        reset: Callable[[], None] | None = getattr(module, "reset_parameters", None) or getattr(
            module, "_reset_parameters", None
        )
        if callable(reset):
            reset()


@torch.no_grad()
def unwritten(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The names of the tensors still holding the poison anywhere (NaN for floats, the minimum for integers)."""
    checked = {n: t for n, t in tensors.items() if t.dtype != torch.bool and t.numel()}
    if not checked:
        return []
    flags = torch.stack(
        [
            t.isnan().any()
            if t.dtype.is_floating_point or t.dtype.is_complex
            else (t == torch.iinfo(t.dtype).min).all()
            for t in checked.values()
        ]
    ).tolist()
    return [name for name, bad in zip(checked, flags) if bad]


_READS = {"item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__", "__array__", "cpu", "cuda"}


def _refuse_reads(func: Any, args: Any, kwargs: dict) -> None:
    """Raise for what would read values of another stage's placeholder or mix it with real tensors."""
    name = getattr(func, "__name__", "")
    flat = [b for a in (*args, *kwargs.values()) for b in (a if isinstance(a, (list, tuple)) else (a,))]
    real = [a for a in flat if type(a) is torch.Tensor and not a.is_meta]
    moved = name == "to" and any(
        isinstance(a, (str, torch.device)) and torch.device(a).type != "meta" for a in (*args[1:], *kwargs.values())
    )
    if name in _READS or real or moved:
        raise RuntimeError(
            f"pd2bw: {name or func}() on a parameter of a layer another pipeline stage runs: this process holds only "
            "its own stage's layers (the others are meta placeholders). Iterate this stage's parameters instead: "
            "engine.parameters(), or in a Lightning callback trainer.strategy.stage_parameters() (its (name, "
            "parameter) pairs) instead of pl_module.parameters()"
        )


class OtherStageTensor(torch.Tensor):
    """What computing on an ``OtherStageParameter`` gives: still a meta placeholder that refuses to be read."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        _refuse_reads(func, args, kwargs)
        return super().__torch_function__(func, types, args, kwargs)


class OtherStageParameter(nn.Parameter):
    """A meta placeholder for a parameter another stage holds. Shape, dtype and meta-only ops work (summaries,
    copies); reading its values (``.item()``, ``float()``, ``.cpu()``...), directly or from a result computed on it,
    or mixing it with real tensors raises an error that says where it lives and what to use instead."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        _refuse_reads(func, args, kwargs)
        return torch.Tensor.__torch_function__.__func__(OtherStageTensor, func, (OtherStageTensor,), args, kwargs)


def release(layer: nn.Module) -> None:
    """Drop a layer this stage does not run: its tensors move to the meta device (no memory), its parameters
    become ``OtherStageParameter`` placeholders."""
    layer.to("meta")
    placeholders: dict[int, nn.Parameter] = {}
    for module in layer.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and not isinstance(param, OtherStageParameter):
                if id(param) not in placeholders:
                    placeholders[id(param)] = OtherStageParameter(param.detach(), param.requires_grad)
                module._parameters[name] = placeholders[id(param)]


def initialize_layers(
    layers: Sequence[nn.Module], indices: Sequence[int], root: nn.Module, init_layer: Callable[[int], None] | None
) -> None:
    """Initialise layers ``indices`` (materialised with a poison): the model's ``init_pipeline_layer(index)`` when
    it has one, else each module's own initialisation (``initialize``)."""
    if init_layer is not None:
        for index in indices:
            init_layer(index)
        return
    owners = hf_owners(root)
    protocol = [o for o in init_weights_owners(root) if any(not p.is_meta for p in o.parameters())]
    covered = {id(sub) for owner in protocol for sub in owner.modules()}
    for index in indices:  # every module no init_weights() covers: Hugging Face's _init_weights or its own reset
        initialize(layers[index], owners, skip=covered)
    for owner in protocol:
        run_init_weights(owner)


def check_initialized(layers: Sequence[nn.Module], indices: Sequence[int], by_init_layer: bool) -> None:
    """Refuse a stage whose layers still hold the poison after initialisation (and the broadcasts of tied and
    replicated tensors), naming the tensor, the module that owns it and the fix."""
    for index in indices:
        layer = layers[index]
        tensors = dict(layer.named_parameters(remove_duplicate=False))
        tensors.update(layer.named_buffers(remove_duplicate=False))
        bad = unwritten(tensors)
        if not bad:
            continue
        name = bad[0]
        owner_name = name.rpartition(".")[0]
        owner = type(layer.get_submodule(owner_name)).__name__
        how = (
            "init_pipeline_layer(index) left it unwritten"
            if by_init_layer
            else (
                f"{owner} has no reset_parameters(), and neither a Hugging Face _init_weights nor an init_weights() "
                "covers it"
            )
        )
        raise RuntimeError(
            f"pd2bw: {name!r} of pipeline layer {index} ({type(layer).__name__}) was not initialised after the model "
            f"was built on the meta device ({how}; {len(bad)} tensor(s): {', '.join(bad[:4])}). Fix: give {owner} a "
            "reset_parameters() that writes every parameter and buffer it owns, or define "
            "init_pipeline_layer(self, index) on the LightningModule (PipelineEngine's init_layer=) to initialise "
            "layer `index` (see docs/models.md, "
            "'Meta initialisation and the rules')"
        )
