"""A griffe extension for the API reference (``mkdocs.yml``): ``PipeDream2BWStrategy``'s parameter table, written
from ``PipelineOptions``' and ``StrategyOptions``' own (the options are documented once, there; ``clip_mode`` from
``Clipping.mode``) and one line for each of Lightning's; and
each default shown as its value (``"2bw"``, not the constant that holds it)."""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

import griffe

LIGHTNING = {
    "accelerator": "Lightning's accelerator (default: the Trainer's).",
    "parallel_devices": "the devices of this node (default: the Trainer's ``devices``).",
    "cluster_environment": "how ranks find each other (default: detected, as for ``DDPStrategy``).",
    "checkpoint_io": "Lightning's checkpoint I/O plugin (the strategy writes sharded DCP checkpoints itself).",
    "precision_plugin": "Lightning's precision plugin (default: from ``Trainer(precision=...)``).",
    "process_group_backend": "``nccl`` on GPUs, ``gloo`` on CPUs by default.",
    "timeout": "of the collectives of the process groups (Lightning's default, 30 minutes).",
    # the strategy's own, not an engine option: weights only, read once at setup (lightning/init_from.py)
    "init_from": "a fit starts from these weights (a pd2bw checkpoint, a consolidated file, a Hugging Face "
    "directory), with a fresh optimizer, schedule and step.",
}


def _first_sentence(text: str) -> str:
    flat = " ".join(text.split())
    end = re.search(r"(?<!e\.g)(?<!i\.e)\.\s", flat)  # not at "e.g." or "i.e."
    return flat if end is None else flat[: end.start() + 1]


def _parameters(obj: griffe.Object) -> list[griffe.DocstringParameter]:
    sections = (
        obj.docstring.parse("google", warn_unknown_params=False, warn_missing_types=False) if obj.docstring else []
    )
    return next((s.value for s in sections if s.kind.value == "parameters"), [])


def _runtime_defaults(obj: griffe.Class) -> None:
    """Defaults written as a name (``rules.DEFAULT_MODE``) shown as the value they hold."""
    init = obj.members.get("__init__")
    if init is None:
        return
    module = importlib.import_module(obj.module.path)
    live = inspect.signature(getattr(module, obj.name).__init__).parameters
    for parameter in init.parameters:
        if isinstance(parameter.default, griffe.Expr) and parameter.name in live:
            parameter.default = repr(live[parameter.name].default)


class OptionsTables(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name != "lightning_pd2bw":
            return
        options, strategy = pkg["engine.options.PipelineOptions"], pkg["lightning.strategy.PipeDream2BWStrategy"]
        own, clipping = pkg["lightning.options.StrategyOptions"], pkg["engine.options.Clipping"]
        for cls in (options, own, clipping, strategy):
            _runtime_defaults(cls)
        described = {p.name: _first_sentence(p.description) for cls in (options, own) for p in _parameters(cls)}
        clip_mode = next(p for p in _parameters(clipping) if p.name == "mode")  # the flat key of Clipping.mode
        described["clip_mode"] = _first_sentence(clip_mode.description)
        lines = []
        for parameter in strategy.members["__init__"].parameters:
            if parameter.name == "self":
                continue
            text = described.get(parameter.name) or LIGHTNING.get(parameter.name)
            if text is None:
                raise ValueError(
                    f"PipeDream2BWStrategy({parameter.name}=...) is documented neither in options nor here"
                )
            lines.append(f"    {parameter.name}: {text}")
        strategy.docstring.value = strategy.docstring.value.rstrip() + "\n\nArgs:\n" + "\n".join(lines)
