"""A stage's part of a checkpoint as name-keyed entries of ``torch.distributed.checkpoint`` (DCP), and back.

One flat namespace; every rank saves the entries of its stage, DCP writes each name once (replicas, and the two
stages holding a tied weight, are deduplicated by name and the writes spread over the ranks)::

    model/<state-dict key>                      the LightningModule's state-dict tensors
    optim/<k>/<parameter name>/<state key>      optimizer k's state of a parameter (its first name, when tied)
    optim_groups/<k>/stage-<s>                  optimizer k's param groups' hyper-parameters on stage s
    callbacks/stage-<s>                         the stage's callback states, sparsity masks taken out
    masks/<weight name>                         sparsity masks

Loading asks DCP for exactly this stage's names, so a rank reads only the bytes it owns at any depth x width:
the model's tensors are read in place into the module, optimizer state into tensors allocated from DCP's
metadata on the stage's device.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

STAGE_KEYS = ("state_dict", "optimizer_states", "optimizer_param_names", "callbacks")


def entries_of(checkpoint: Mapping[str, Any], stage: int) -> dict[str, Any]:
    """The DCP entries of one stage's checkpoint (Lightning's dict, plus ``optimizer_param_names``)."""
    out: dict[str, Any] = {f"model/{k}": v for k, v in checkpoint.get("state_dict", {}).items()}
    names = names_per_optimizer(checkpoint.get("optimizer_param_names") or [])
    for k, (state, names_of) in enumerate(zip(checkpoint.get("optimizer_states") or [], names)):
        for index, values in state["state"].items():
            out.update({f"optim/{k}/{names_of[index][0]}/{key}": v for key, v in values.items()})
        out[f"optim_groups/{k}/stage-{stage}"] = [
            {key: v for key, v in group.items() if key != "params"} for group in state["param_groups"]
        ]
    callbacks: dict[str, Any] = {}
    for key, state in checkpoint.get("callbacks", {}).items():
        sparsifier = state.get("sparsifier") if isinstance(state, dict) else None
        if sparsifier:
            out.update({f"masks/{name}": mask for name, mask in sparsifier["masks"].items()})
            state = {**state, "sparsifier": {**sparsifier, "masks": sorted(sparsifier["masks"])}}
        callbacks[key] = state
    out[f"callbacks/stage-{stage}"] = callbacks
    return out


def names_per_optimizer(saved: list[Any]) -> list[list[list[str]]]:
    """``optimizer_param_names`` as one list per optimizer (before several optimizers: one flat list)."""
    if saved and saved[0] and isinstance(saved[0][0], str):
        return [saved]
    return saved


def request_for(
    metadata: Mapping[str, Any],
    *,
    stage: int,
    same_layout: bool,
    model: Mapping[str, torch.Tensor],
    names: list[list[list[str]]],
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """What this stage reads: its model tensors (``model``: read into in place), each optimizer's state of its
    parameters (``names[k][i]``: the names of parameter ``i`` of optimizer ``k``), the saved groups, its callback
    states (on a reshard every stage's: they are small and merged) and the masks of its weights. ``metadata``:
    DCP's ``state_dict_metadata``."""
    missing = sorted(k for k in model if f"model/{k}" not in metadata)
    if missing:
        raise KeyError(
            f"the checkpoint does not hold this stage's entries {missing[:5]}: it was written for another model; "
            "build the same model as the checkpoint's run"
        )
    wrong = [
        f"{k}: checkpoint {tuple(metadata[f'model/{k}'].size)}, model {tuple(v.shape)}"
        for k, v in model.items()
        if tuple(metadata[f"model/{k}"].size) != tuple(v.shape)
    ]
    if wrong:
        raise ValueError(
            f"the checkpoint's shapes differ from this model's ({'; '.join(wrong[:3])}): it was written for another "
            "model configuration; build the same model (model.* settings) as the checkpoint's run"
        )
    request: dict[str, Any] = {f"model/{k}": v.detach() for k, v in model.items()}
    saved_optimizers = {name.split("/")[1] for name in metadata if name.startswith("optim_groups/")}
    if saved_optimizers and len(saved_optimizers) != len(names):
        raise ValueError(
            f"the checkpoint was written with {len(saved_optimizers)} optimizer(s), this run configures {len(names)}: "
            "configure the same optimizers as the checkpoint's run"
        )
    if saved_optimizers:
        stored = _optimizer_entries(metadata)
        for k, names_of in enumerate(names):
            for param_names in names_of:
                saved = next((n for n in param_names if (k, n) in stored), None)
                for key in stored.get((k, saved), []):
                    request[f"optim/{k}/{saved}/{key}"] = empty_for(metadata[f"optim/{k}/{saved}/{key}"], device)
            groups = f"optim_groups/{k}/stage-{stage}"
            request[groups if same_layout and groups in metadata else f"optim_groups/{k}/stage-0"] = None
    local = {n for names_of in names for param_names in names_of for n in param_names} | set(model)
    own = f"callbacks/stage-{stage}"
    for name in metadata:
        if name.startswith("callbacks/") and (name == own or not same_layout or own not in metadata):
            request[name] = None  # a reshard merges every stage's (small) callback states
        elif name.startswith("masks/") and name[len("masks/") :] in local:
            request[name] = empty_for(metadata[name], device)
    return request


def _optimizer_entries(metadata: Mapping[str, Any]) -> dict[tuple[int, str], list[str]]:
    stored: dict[tuple[int, str], list[str]] = {}
    for name in metadata:
        if name.startswith("optim/"):
            _, k, param, key = name.split("/", 3)
            stored.setdefault((int(k), param), []).append(key)
    return stored


def empty_for(entry: Any, device: torch.device | str) -> Any:
    if isinstance(entry, BytesStorageMetadata):
        return None  # an object: DCP puts the saved one here
    assert isinstance(entry, TensorStorageMetadata)
    # scalars (e.g. Adam's step) stay on the host, as the optimizer keeps them unless capturable/fused
    where = "cpu" if len(entry.size) == 0 else device
    return torch.empty(entry.size, dtype=entry.properties.dtype, device=where)


def stage_checkpoint(
    loaded: Mapping[str, Any], *, stage: int, same_layout: bool, names: list[list[list[str]]], fresh: list[dict]
) -> dict[str, Any]:
    """Lightning's per-stage checkpoint keys from what ``request_for`` asked and DCP filled: ``state_dict``,
    ``optimizer_states`` (indexed like this run's optimizers; ``fresh[k]``: optimizer k's ``state_dict()``) and
    ``callbacks`` (this stage's; on a reshard, every stage's merged, masks of this stage's weights)."""
    out: dict[str, Any] = {"state_dict": {k[len("model/") :]: v for k, v in loaded.items() if k.startswith("model/")}}
    if any(k.startswith("optim_groups/") for k in loaded):
        by_param: dict[tuple[int, str], dict[str, Any]] = {}
        for key, value in loaded.items():
            if key.startswith("optim/"):
                _, k, param, item = key.split("/", 3)
                by_param.setdefault((int(k), param), {})[item] = value
        out["optimizer_states"] = []
        for k, (names_of, fresh_state) in enumerate(zip(names, fresh)):
            state = {}
            for index, param_names in enumerate(names_of):
                found = next((by_param[(k, n)] for n in param_names if (k, n) in by_param), None)
                if found is not None:
                    state[index] = found
            saved_groups = next(v for key, v in loaded.items() if key.startswith(f"optim_groups/{k}/"))
            groups = [
                {**saved, "params": group["params"]} for group, saved in zip(fresh_state["param_groups"], saved_groups)
            ]
            out["optimizer_states"].append({"state": state, "param_groups": groups})
    masks = {k[len("masks/") :]: v for k, v in loaded.items() if k.startswith("masks/")}
    own = f"callbacks/stage-{stage}"
    stages = [own] if same_layout and own in loaded else sorted(k for k in loaded if k.startswith("callbacks/"))
    out["callbacks"] = {}
    for key in stages:
        merge_callbacks(out["callbacks"], loaded[key], masks)
    return out


def merge_callbacks(into: dict[str, Any], states: Mapping[str, Any], masks: Mapping[str, torch.Tensor]) -> None:
    """Callback states are per stage; a sparsifier's masks (by weight name) come from ``masks``; the per-layer
    target densities are every stage's view of the whole model (measuring is a collective), kept whole."""
    for key, state in states.items():
        sparsifier = state.get("sparsifier") if isinstance(state, dict) else None
        if key not in into:
            into[key] = dict(state) if isinstance(state, dict) else state
            if sparsifier:
                into[key]["sparsifier"] = {**sparsifier, "masks": {}, "layer_targets": {}}
        if sparsifier:
            target = into[key]["sparsifier"]
            target["masks"].update({n: masks[n] for n in sparsifier["masks"] if n in masks})
            target["layer_targets"].update(sparsifier.get("layer_targets", {}))
