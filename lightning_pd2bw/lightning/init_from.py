"""``init_from``: start a run from another run's weights, at any layout, with a fresh optimizer, schedule and step.

``ckpt_path=`` resumes the same run (its step, optimizer, schedules, data position). ``init_from=PATH`` takes only
the weights, from

* a pd2bw checkpoint directory (any depth x width: each rank reads only its stage's entries),
* a consolidated file (``pd2bw-consolidate``'s Lightning checkpoint, or a plain state dict; read with
  ``weights_only=True``),
* a Hugging Face model directory (``config.json`` with ``model.safetensors``, its sharded index, or
  ``pytorch_model.bin``) for ``HFCausalLM`` / ``HFMaskedLM``, mapped onto the pipeline's names through the model's
  own parameters; a GPT-2 directory also for our ``GPT`` (GPT-2's architecture: ``models/gpt2_export.py``).

Every parameter of this stage must be there with its shape, or the run is refused naming the first missing or
mismatched ones. Sparsity masks do not come along (a sparsity callback builds its own from the weights).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import store
from ..errors import Refusal


class InitFromError(Refusal, ValueError):
    """``init_from`` names weights this model cannot start from; the message says which and why."""


def initialise(path: str | Path, module: Any, state: dict[str, torch.Tensor]) -> int:
    """Copy the weights at ``path`` into this stage's ``state`` (its non-meta tensors by the module's names);
    returns the number of parameters set."""
    wanted = {name for name, param in module.named_parameters(remove_duplicate=False) if not param.is_meta}
    source = _read(Path(path), module, wanted)
    missing = sorted(name for name in wanted if name not in source)
    if missing:
        raise InitFromError(
            f"init_from={str(path)!r} has no weights for {missing[:4]}{' ...' if len(missing) > 4 else ''} of this "
            "model: it was written for another model; build the model it was trained as (model.* settings)"
        )
    wrong = [
        f"{name}: {tuple(source[name].shape)} there, {tuple(state[name].shape)} here"
        for name in sorted(wanted)
        if name in state and tuple(source[name].shape) != tuple(state[name].shape)
    ]
    if wrong:
        raise InitFromError(
            f"init_from={str(path)!r}: shapes differ ({'; '.join(wrong[:3])}); build the model it was trained as"
        )
    with torch.no_grad():
        for name in wanted:
            if name in state:
                state[name].copy_(source[name].to(state[name].dtype))
    return len(wanted)


def _read(path: Path, module: Any, wanted: set[str]) -> dict[str, torch.Tensor]:
    if (path / store.MANIFEST).is_file():
        entries = store.read_entries(path, "model/", names={f"model/{n}" for n in wanted})
        return {name[len("model/") :]: value for name, value in entries.items()}
    if path.is_file():
        loaded = torch.load(path, map_location="cpu", weights_only=True)
        return loaded.get("state_dict", loaded) if isinstance(loaded, dict) else {}
    if (path / "config.json").is_file():
        return _hugging_face(path, module, wanted)
    raise InitFromError(
        f"init_from={str(path)!r} is neither a pd2bw checkpoint directory (manifest.json), a consolidated file, nor a "
        "Hugging Face model directory (config.json); give one of those"
    )


def _hugging_face(path: Path, module: Any, wanted: set[str]) -> dict[str, torch.Tensor]:
    model = getattr(module, "hf_model", None)
    if model is None:
        return _gpt2(path, module)
    tensors = _hf_tensors(path)
    hf_names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        hf_names.setdefault(id(param), []).append(name)
    # a tied output embedding is saved once, as the input embedding (and is its own tensor on the last stage)
    tied = getattr(model.config, "tie_word_embeddings", False) and model.get_output_embeddings() is not None
    if tied:
        inputs = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())
        hf_names.setdefault(id(model.get_output_embeddings().weight), []).append(f"{inputs}.weight")
    out = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if name in wanted:
            found = [n for n in hf_names.get(id(param), []) if n in tensors]  # tied weights: any of their names
            if found:
                out[name] = tensors[found[0]]
    return out


def _gpt2(path: Path, module: Any) -> dict[str, torch.Tensor]:
    """A Hugging Face GPT-2 directory for our ``GPT`` (GPT-2's architecture; ``gpt2_export.from_gpt2`` maps it)."""
    from ..models.core import GPTConfig

    config = getattr(module, "config", None)
    if type(config) is not GPTConfig:
        raise InitFromError(
            f"init_from={str(path)!r} is a Hugging Face model directory; it initialises HFCausalLM / HFMaskedLM "
            f"models, and lightning_pd2bw.models.GPT from a GPT-2 directory, not {type(module).__name__}"
        )
    from ..models.gpt2_export import from_gpt2

    try:
        return from_gpt2(_hf_tensors(path), json.loads((path / "config.json").read_text()), config)
    except ValueError as error:
        raise InitFromError(str(error).replace("init_from:", f"init_from={str(path)!r}:", 1)) from None


def _hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face model directory (safetensors or ``pytorch_model.bin``, sharded or not)."""
    tensors: dict[str, torch.Tensor] = {}
    for file in _hf_files(path):
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            tensors.update(load_file(str(file)))
        else:
            tensors.update(torch.load(file, map_location="cpu", weights_only=True))
    return tensors


def _hf_files(path: Path) -> list[Path]:
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (path / index).is_file():
            return sorted({path / f for f in json.loads((path / index).read_text())["weight_map"].values()})
    for single in ("model.safetensors", "pytorch_model.bin"):
        if (path / single).is_file():
            return [path / single]
    raise InitFromError(f"init_from={str(path)!r}: no model.safetensors or pytorch_model.bin in the directory")
