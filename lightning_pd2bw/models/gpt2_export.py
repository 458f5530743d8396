"""Our GPT in Hugging Face's GPT-2 format and back: config.json + safetensors that ``GPT2LMHeadModel`` loads, and
a GPT-2 directory's weights under our names (``init_from=`` a Hugging Face GPT-2 directory).

Our GPT is GPT-2's architecture (learned positions, pre-norm blocks, tied embedding, biases everywhere);
two things differ and are mapped here: GPT-2 stores its projections as ``Conv1D`` (weight ``[in, out]``,
the transpose of ``nn.Linear``), and our MLP's GELU is a config choice: ``gelu="exact"`` (erf, the default) is
``transformers``' ``activation_function="gelu"``; ``gelu="tanh"`` is ``"gelu_new"``, what GPT-2's checkpoints use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

_BLOCK = {  # ours (under layers.{i+1}.) -> GPT-2's (under transformer.h.{i}.); True: a Conv1D weight
    "ln_1.weight": ("ln_1.weight", False),
    "ln_1.bias": ("ln_1.bias", False),
    "attn.qkv.weight": ("attn.c_attn.weight", True),
    "attn.qkv.bias": ("attn.c_attn.bias", False),
    "attn.proj.weight": ("attn.c_proj.weight", True),
    "attn.proj.bias": ("attn.c_proj.bias", False),
    "ln_2.weight": ("ln_2.weight", False),
    "ln_2.bias": ("ln_2.bias", False),
    "fc.weight": ("mlp.c_fc.weight", True),
    "fc.bias": ("mlp.c_fc.bias", False),
    "fc_proj.weight": ("mlp.c_proj.weight", True),
    "fc_proj.bias": ("mlp.c_proj.bias", False),
}


ACTIVATIONS = {"exact": "gelu", "tanh": "gelu_new"}  # our GPTConfig.gelu -> GPT-2's activation_function
_TANH = ("gelu_new", "gelu_pytorch_tanh")  # transformers' names of the tanh approximation


def _names(n_layer: int) -> dict[str, tuple[str, bool]]:
    """GPT-2's parameter names -> (ours, whether GPT-2 stores it transposed as a ``Conv1D``)."""
    head = f"layers.{n_layer + 1}"
    names = {
        "transformer.wte.weight": ("layers.0.wte.weight", False),
        "transformer.wpe.weight": ("layers.0.wpe.weight", False),
        "transformer.ln_f.weight": (f"{head}.ln_f.weight", False),
        "transformer.ln_f.bias": (f"{head}.ln_f.bias", False),
    }
    for i in range(n_layer):
        for ours, (theirs, conv) in _BLOCK.items():
            names[f"transformer.h.{i}.{theirs}"] = (f"layers.{i + 1}.{ours}", conv)
    return names


def from_gpt2(tensors: dict[str, torch.Tensor], hf_config: dict[str, Any], config: Any) -> dict[str, torch.Tensor]:
    """A Hugging Face GPT-2 directory's tensors (``hf_config``: its config.json) under our GPT's names and layouts,
    for the model ``config`` (our ``GPTConfig``); the tied head's weight is the token embedding. Refused, naming
    the key to set, where the directory is not a GPT-2 our GPT computes alike: another ``model_type``, another depth
    or GELU, a LayerNorm epsilon other than 1e-5, GPT-2's optional attention scalings."""
    where = f"init_from: the Hugging Face directory (model_type={hf_config.get('model_type')!r})"
    if hf_config.get("model_type") != "gpt2":
        raise ValueError(f"{where} is not GPT-2; lightning_pd2bw.models.GPT starts from GPT-2 directories only")
    activation = hf_config.get("activation_function", "gelu_new")
    gelu = "tanh" if activation in _TANH else "exact" if activation == "gelu" else None
    if gelu is None or gelu != config.gelu:
        raise ValueError(
            f"{where} uses activation_function={activation!r}; this model's MLP has gelu={config.gelu!r}: "
            + (f"set model.config.gelu={gelu}" if gelu else "only 'gelu' (exact) and 'gelu_new' (tanh) are ours")
        )
    if hf_config.get("n_layer") != config.n_layer:
        raise ValueError(f"{where} has n_layer={hf_config.get('n_layer')}; set model.config.n_layer to it")
    if hf_config.get("layer_norm_epsilon", 1e-5) != 1e-5:
        raise ValueError(f"{where} has layer_norm_epsilon={hf_config['layer_norm_epsilon']}; ours is 1e-5")
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if hf_config.get(flag):
            raise ValueError(f"{where} sets {flag}=true, which our GPT's attention does not do")
    if not hf_config.get("scale_attn_weights", True):
        raise ValueError(f"{where} sets scale_attn_weights=false; our attention scales by 1/sqrt(head size)")
    out = {}
    for theirs, (ours, conv) in _names(config.n_layer).items():
        found = tensors.get(theirs, tensors.get(theirs.removeprefix("transformer.")))  # GPT2Model saves no prefix
        if found is not None:
            out[ours] = found.t().contiguous() if conv else found
    if "layers.0.wte.weight" in out:
        out[f"layers.{config.n_layer + 1}.weight"] = out["layers.0.wte.weight"]  # the head is tied, as GPT-2's
    return out


def gpt2_state_dict(state: dict[str, torch.Tensor], n_layer: int) -> dict[str, torch.Tensor]:
    """Our GPT's state dict (``layers.0`` embedding, ``layers.1..n_layer`` blocks, ``layers.{n_layer+1}`` head)
    under GPT-2's names and layouts. Refuses a state dict that is not our GPT's, naming what is missing."""
    head = f"layers.{n_layer + 1}"
    names = _names(n_layer)
    missing = sorted(ours for ours, _ in names.values() if ours not in state)
    extra = sorted(k for k in state if k not in {ours for ours, _ in names.values()} and not k.startswith(head))
    if missing or extra or "layers.0.ln.weight" in state:
        raise ValueError(
            "--format hf exports lightning_pd2bw.models.GPT (GPT-2's architecture); this checkpoint's weights are not "
            f"its layout (missing: {missing[:4]}, unexpected: {extra[:4]}). A Hugging Face-built model "
            "(HFCausalLM, HFMaskedLM) exports with its own save_pretrained(directory, consolidate(checkpoint))"
        )
    out = {theirs: state[ours].t().contiguous() if conv else state[ours] for theirs, (ours, conv) in names.items()}
    out["lm_head.weight"] = out["transformer.wte.weight"]  # tied, as in our GPT
    return out


def save_gpt2(directory: str | Path, state: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    """Write ``directory`` (config.json, model.safetensors) for ``GPT2LMHeadModel.from_pretrained``.
    ``config``: our ``GPTConfig`` as a dict (a checkpoint's ``hyper_parameters["config"]``)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_config = GPT2Config(
        vocab_size=config["vocab_size"],
        n_positions=config["block_size"],
        n_embd=config["n_embd"],
        n_layer=config["n_layer"],
        n_head=config["n_head"],
        activation_function=ACTIVATIONS[config.get("gelu", "exact")],  # our MLP's GELU
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=True,
        # GPT-2's defaults (50256) name tokens a smaller vocabulary (bytes: 256) does not have; ours has no BOS/EOS
        bos_token_id=_token_id(50256, config["vocab_size"]),
        eos_token_id=_token_id(50256, config["vocab_size"]),
    )
    with torch.device("meta"):
        model = GPT2LMHeadModel(hf_config)
    model.load_state_dict(gpt2_state_dict(state, config["n_layer"]), assign=True, strict=True)
    model.tie_weights()
    model.save_pretrained(directory)
    return Path(directory)


def _token_id(default: int, vocab_size: int) -> int | None:
    """GPT-2's special token id where the vocabulary has it, else None (no such token)."""
    return default if default < vocab_size else None


def export_checkpoint(path: str | Path, out: str | Path) -> Path:
    """A sharded checkpoint of ``lightning_pd2bw.models.GPT`` as a Hugging Face GPT-2 directory
    (``pd2bw-consolidate PATH OUT --format hf``)."""
    from ..checkpoint.store import consolidate, read_meta

    config = (read_meta(path).get("hyper_parameters") or {}).get("config")
    if not isinstance(config, dict) or "n_layer" not in config:
        raise ValueError(
            f"{path}: no GPT config in the checkpoint's hyper-parameters; --format hf exports checkpoints of "
            "lightning_pd2bw.models.GPT"
        )
    return save_gpt2(out, consolidate(path), config)
