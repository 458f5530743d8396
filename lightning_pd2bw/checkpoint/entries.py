"""A stage's part of a checkpoint as name-keyed entries of ``torch.distributed.checkpoint`` (DCP), and back.

One flat namespace; every rank saves the entries of its stage, DCP writes each name once (replicas, and the two
stages holding a tied weight, are deduplicated by name and the writes spread over the ranks)::

    model/<state-dict key>                      the LightningModule's state-dict tensors
    optim/<k>/<parameter name>/<state key>      optimizer k's state of a parameter (its first name, when tied)
    optim_groups/<k>/stage-<s>                  optimizer k's param groups' hyper-parameters on stage s
    callbacks/stage-<s>                         the stage's callback states, their per-parameter tensors taken out
    <entry>/<parameter name>                    a callback's per-parameter tensors (``BY_PARAMETER``: sparsity's
                                                masks are ``masks/<weight name>``)

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
OWN_PREFIXES = ("model", "optim", "optim_groups", "callbacks")  # the entries of the checkpoint's own parts
BY_PARAMETER = "by_parameter"
"""The protocol by which a callback's state contributes per-parameter entries: a dict anywhere in its state may hold
``{"by_parameter": {entry: {parameter name: value}}}``. Tensors are stored as entries ``<entry>/<parameter name>``
(the state keeps their names), so a stage reads only its own parameters' at any layout; other values (floats, ...)
stay in the state. On a reshard every stage's state is merged: each ``by_parameter`` mapping is unioned, other keys
come from the first stage that has them. Entries named ``masks`` are summarised in the manifest (density per
parameter). The sparsity callback's masks and per-layer targets use it (``sparsity/masks.py``)."""


def entries_of(checkpoint: Mapping[str, Any], stage: int) -> dict[str, Any]:
    """The DCP entries of one stage's checkpoint (Lightning's dict, plus ``optimizer_param_names``)."""
    out: dict[str, Any] = {f"model/{k}": v for k, v in checkpoint.get("state_dict", {}).items()}
    names = checkpoint.get("optimizer_param_names") or []  # per optimizer, per parameter: its names
    for k, (state, names_of) in enumerate(zip(checkpoint.get("optimizer_states") or [], names)):
        for index, values in state["state"].items():
            out.update({f"optim/{k}/{names_of[index][0]}/{key}": v for key, v in values.items()})
        out[f"optim_groups/{k}/stage-{stage}"] = [
            {key: v for key, v in group.items() if key != "params"} for group in state["param_groups"]
        ]
    callbacks: dict[str, Any] = {}
    for key, state in checkpoint.get("callbacks", {}).items():
        callbacks[key], tensors = split_by_parameter(state)
        out.update(tensors)
    out[f"callbacks/stage-{stage}"] = callbacks
    return out


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
    if saved_optimizers and names and len(saved_optimizers) != len(names):  # no names: evaluation, no optimizer
        raise ValueError(
            f"the checkpoint was written with {len(saved_optimizers)} optimizer(s), this run configures {len(names)}: "
            "configure the same optimizers as the checkpoint's run"
        )
    if saved_optimizers and names:
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
        elif "/" in name and name.split("/", 1)[0] not in OWN_PREFIXES and name.split("/", 1)[1] in local:
            request[name] = empty_for(metadata[name], device)  # a callback's tensor of one of this stage's parameters
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
    own = f"callbacks/stage-{stage}"
    stages = [own] if same_layout and own in loaded else sorted(k for k in loaded if k.startswith("callbacks/"))
    out["callbacks"] = {}
    for key in stages:
        for name, state in loaded[key].items():
            out["callbacks"][name] = merge_state(out["callbacks"].get(name), state, loaded)
    return out


def split_by_parameter(state: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """``state`` with the tensors under each ``BY_PARAMETER`` taken out (their names kept, sorted), and those
    tensors as entries ``<entry>/<parameter name>``."""
    if not isinstance(state, Mapping):
        return state, {}
    out: dict[str, Any] = {}
    entries: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key != BY_PARAMETER:
            out[key], inner = split_by_parameter(value)
            entries.update(inner)
            continue
        out[key] = {}
        for entry, values in value.items():
            tensors = {n: v for n, v in values.items() if isinstance(v, torch.Tensor)}
            if tensors and len(tensors) != len(values):
                raise ValueError(f"{BY_PARAMETER}[{entry!r}] mixes tensors and other values: give each its own entry")
            if entry in OWN_PREFIXES or any("/" in n for n in values):
                raise ValueError(f"{BY_PARAMETER}[{entry!r}]: the entry may not be {OWN_PREFIXES} or contain '/'")
            entries.update({f"{entry}/{n}": v for n, v in tensors.items()})
            out[key][entry] = sorted(tensors) if tensors else dict(values)
    return out, entries


def merge_state(into: Any, state: Any, loaded: Mapping[str, Any]) -> Any:
    """``state`` (a stage's saved callback state) merged into ``into`` (the states merged so far, or None): each
    ``BY_PARAMETER`` mapping unioned, its stored tensors put back from ``loaded`` (those this stage asked for: its own
    parameters'); any other key kept from the first state that has it."""
    if not isinstance(state, Mapping):
        return state if into is None else into
    merged = dict(into) if isinstance(into, Mapping) else {}
    for key, value in state.items():
        if key == BY_PARAMETER:
            parts = {entry: dict(values) for entry, values in merged.get(key, {}).items()}
            for entry, values in value.items():
                if isinstance(values, list):  # tensors stored as entries
                    values = {n: loaded[f"{entry}/{n}"] for n in values if f"{entry}/{n}" in loaded}
                parts.setdefault(entry, {}).update(values)
            merged[key] = parts
        elif key not in merged or isinstance(value, Mapping):
            merged[key] = merge_state(merged.get(key), value, loaded)
    return merged


def by_parameter(state: Any, entry: str) -> dict[str, Any]:
    """Every ``BY_PARAMETER[entry]`` value in ``state`` (a callback's state, at any depth), by parameter name."""
    found: dict[str, Any] = {}
    if isinstance(state, Mapping):
        for key, value in state.items():
            if key == BY_PARAMETER:
                found.update(value.get(entry, {}))
            else:
                found.update(by_parameter(value, entry))
    return found
