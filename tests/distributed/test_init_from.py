"""``init_from`` (issue 65): a run starts from another run's weights at another layout, or from a Hugging Face
model directory, exactly, with a fresh step count; shapes that differ are refused by name."""

from __future__ import annotations

import pytest
import torch

from lightning_pd2bw.checkpoint import consolidate
from lightning_pd2bw.lightning.init_from import InitFromError, initialise

from .launch import ROOT, torchrun_script

RUNNER = ROOT / "tests" / "distributed" / "run_init_from.py"


def started(out, world: int) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for rank in range(world):
        record = torch.load(out / f"start-rank-{rank}.pt", weights_only=True)
        assert record["global_step"] == 0, "a fresh step count"
        merged.update(record["state"])
    return merged


def test_a_run_starts_from_a_checkpoint_written_at_another_layout(tmp_path):
    torchrun_script(RUNNER, [str(tmp_path), "gpt", "-", "2"], 2)  # 2 stages, trained 3 steps
    source = consolidate(tmp_path / "final.ckpt")
    second = tmp_path / "again"
    second.mkdir()
    torchrun_script(RUNNER, [str(second), "gpt", str(tmp_path / "final.ckpt"), "1"], 1)  # one stage holds it all
    weights = started(second, 1)
    params = [name for name in source if not name.endswith(("bias_mask", "attn.bias"))]
    assert params
    for name in params:
        if name in weights:
            assert torch.equal(weights[name], source[name].float()), name
    assert set(params) <= set(weights)


def test_a_run_starts_from_a_hugging_face_directory(tmp_path):
    pytest.importorskip("transformers")
    from tests.distributed import hf_models

    torch.manual_seed(3)
    pretrained = hf_models.build("gpt2")
    pretrained.configure_model()
    directory = tmp_path / "hf"
    pretrained.save_pretrained(str(directory))
    expected = {n: p.detach().float() for n, p in pretrained.named_parameters()}
    torchrun_script(RUNNER, [str(tmp_path), "hf", str(directory), "2"], 2)
    weights = started(tmp_path, 2)
    for name, value in expected.items():
        assert name in weights, name
        assert torch.equal(weights[name], value), name


def test_our_gpt_starts_from_a_gpt2_directory_written_by_transformers(tmp_path):
    """The case's GPT (3 blocks, width 16, exact GELU) at 2 stages from ``GPT2LMHeadModel.save_pretrained``: every
    weight as GPT-2 holds it, its ``Conv1D`` projections transposed, the head tied to the token embedding."""
    transformers = pytest.importorskip("transformers")
    from tests.distributed.cases import SEQ_LEN

    torch.manual_seed(5)
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=SEQ_LEN, n_embd=16, n_layer=3, n_head=2, activation_function="gelu"
    )
    gpt2 = transformers.GPT2LMHeadModel(config)
    gpt2.save_pretrained(tmp_path / "hf")
    theirs = {n: p.detach().float() for n, p in gpt2.named_parameters(remove_duplicate=False)}
    torchrun_script(RUNNER, [str(tmp_path), "gpt", str(tmp_path / "hf"), "2"], 2)
    weights = started(tmp_path, 2)
    assert torch.equal(weights["layers.0.wte.weight"], theirs["transformer.wte.weight"])
    assert torch.equal(weights["layers.0.wpe.weight"], theirs["transformer.wpe.weight"])
    assert torch.equal(weights["layers.4.weight"], theirs["lm_head.weight"]), "the last stage's tied head"
    assert torch.equal(weights["layers.4.ln_f.bias"], theirs["transformer.ln_f.bias"])
    for i in range(3):
        assert torch.equal(
            weights[f"layers.{i + 1}.attn.qkv.weight"], theirs[f"transformer.h.{i}.attn.c_attn.weight"].t()
        )
        assert torch.equal(
            weights[f"layers.{i + 1}.fc_proj.weight"], theirs[f"transformer.h.{i}.mlp.c_proj.weight"].t()
        )
        assert torch.equal(weights[f"layers.{i + 1}.ln_2.weight"], theirs[f"transformer.h.{i}.ln_2.weight"])
        assert torch.equal(weights[f"layers.{i + 1}.fc.bias"], theirs[f"transformer.h.{i}.mlp.c_fc.bias"])


def test_other_shapes_are_refused_by_name(tmp_path):
    from lightning_pd2bw.models import GPT, GPTConfig

    small, wide = GPT(GPTConfig(n_layer=1, n_embd=16, n_head=2)), GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2))
    small.configure_model()
    wide.configure_model()
    torch.save({"state_dict": small.state_dict()}, tmp_path / "small.ckpt")
    with pytest.raises(InitFromError, match=r"init_from=.*small.ckpt.*shapes differ \(layers\.0\..*\(256, 16\) there"):
        initialise(tmp_path / "small.ckpt", wide, wide.state_dict())
    with pytest.raises(InitFromError, match="neither a pd2bw checkpoint directory"):
        initialise(tmp_path, wide, wide.state_dict())
