"""Layers leave the meta device initialised as the whole module on one device would be, or setup refuses them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pd2bw.engine.materialize import (
    check_initialized,
    initialize_layers,
    materialize,
    parameters_on_meta,
    unwritten,
)
from lightning_pd2bw.lightning.strategy import pipeline_layers_of


class CausalMix(nn.Module):
    """A layer with its own parameter, a child Linear, torch's MultiheadAttention and a causal-mask buffer."""

    def __init__(self, width: int = 8, length: int = 6) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True)
        self.proj = nn.Linear(width, width)
        self.register_buffer("mask", torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1))
        self.register_buffer("positions", torch.arange(length))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.attn(x, x, x, attn_mask=self.mask[: x.shape[1], : x.shape[1]])
        return self.proj(out)


def build() -> list[nn.Module]:
    return [nn.Embedding(10, 8), CausalMix(), nn.LayerNorm(8), nn.Linear(8, 10)]  # top-level Linear: the layer


def staged(layers: list[nn.Module]) -> list[nn.Module]:
    assert materialize(layers, torch.device("cpu"))
    initialize_layers(layers, range(len(layers)), nn.ModuleList(layers), None)
    check_initialized(layers, range(len(layers)), by_init_layer=False)
    return layers


def test_same_values_as_on_one_device():
    """Same seed, same values: every module initialised, the layer itself included, children first."""
    torch.manual_seed(0)
    plain = build()
    with parameters_on_meta():
        meta = build()
    assert all(p.is_meta for layer in meta for p in layer.parameters())
    assert not any(b.is_meta for layer in meta for b in layer.buffers()), "buffers keep their computed values"
    torch.manual_seed(0)
    staged(meta)
    for a, b in zip(plain, meta):
        for (name, x), (_, y) in zip(
            [*a.named_parameters(), *a.named_buffers()], [*b.named_parameters(), *b.named_buffers()], strict=True
        ):
            torch.testing.assert_close(y, x, rtol=0, atol=0, msg=name)
    x = torch.randn(2, 5, 8)
    torch.testing.assert_close(meta[1](x), plain[1](x))


class Scaled(nn.Module):
    """No reset_parameters: its parameter's constructor value is lost on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))


def test_unwritten_parameter_is_refused_by_name():
    with parameters_on_meta():
        layers = [nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), Scaled())]
    materialize(layers, torch.device("cpu"))
    initialize_layers(layers, [0, 1], nn.ModuleList(layers), None)
    assert unwritten(dict(layers[1].named_parameters())) == ["1.scale"]
    with pytest.raises(RuntimeError, match=r"'1.scale' of pipeline layer 1 \(Sequential\).*Fix: give Scaled a reset_"):
        check_initialized(layers, [0, 1], by_init_layer=False)


def test_meta_buffer_left_unwritten_is_refused():
    with torch.device("meta"):  # built by hand on meta: the buffer's value is gone too
        layers = [CausalMix()]
    materialize(layers, torch.device("cpu"))
    initialize_layers(layers, [0], nn.ModuleList(layers), None)
    with pytest.raises(RuntimeError, match="'positions' of pipeline layer 0 .*init_pipeline_layer"):
        check_initialized(layers, [0], by_init_layer=False)


def test_hugging_face_init_weights():
    """A transformers model's layers get its own _init_weights (GPT-2: N(0, 0.02), residual projections scaled by
    1/sqrt(2 n_layer), norms 1 and 0), not torch's defaults."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=4, n_embd=64, n_head=2, vocab_size=128, n_positions=16)
    with parameters_on_meta():
        model = transformers.GPT2LMHeadModel(config)
    blocks = list(model.transformer.h)
    materialize(blocks, torch.device("cpu"))
    initialize_layers(blocks, range(len(blocks)), model, None)
    check_initialized(blocks, range(len(blocks)), by_init_layer=False)
    block = blocks[0]
    assert abs(block.attn.c_attn.weight.std().item() - 0.02) < 0.002
    assert abs(block.attn.c_proj.weight.std().item() - 0.02 / 8**0.5) < 0.001
    assert torch.equal(block.ln_1.weight, torch.ones(64)) and torch.equal(block.attn.c_attn.bias, torch.zeros(192))


def test_llama_rotary_tables_are_the_plain_modules():
    transformers = pytest.importorskip("transformers")
    from lightning_pd2bw.models.hf import HFCausalLM

    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=64
    )
    plain = HFCausalLM(config)
    plain.configure_model()
    with parameters_on_meta():
        meta = HFCausalLM(config)
        meta.configure_model()
    layers = list(meta.layers)
    materialize(layers, torch.device("cpu"))
    initialize_layers(layers, range(len(layers)), meta, meta.init_pipeline_layer)
    check_initialized(layers, range(len(layers)), by_init_layer=True)
    torch.testing.assert_close(meta.layers[1].rotary.inv_freq, plain.layers[1].rotary.inv_freq, rtol=0, atol=0)
    meta.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 64, (2, 9))
    torch.testing.assert_close(meta(ids), plain.hf_model(ids).logits)


def test_parameters_outside_the_layers_are_refused():
    class WithTemperature(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
            self.temperature = nn.Parameter(torch.ones(()))

        def pipeline_inputs(self, batch):
            return batch

        def pipeline_loss(self, out, batch):
            return (out / self.temperature).sum()

    with pytest.raises(ValueError, match=r"parameters outside pipeline_layers\(\): temperature\. .*Move it into the"):
        pipeline_layers_of(WithTemperature())


def test_hf_model_trains_unchanged_without_the_pipeline():
    """The same module under Lightning's default strategy: its loss is the Hugging Face model's own."""
    transformers = pytest.importorskip("transformers")
    import lightning.pytorch as pl

    from lightning_pd2bw.models.hf import HFCausalLM

    model = HFCausalLM(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8))
    ids = torch.randint(0, 32, (8, 8))
    rows = [{"input_ids": ids[i], "attention_mask": torch.ones(8, dtype=torch.long)} for i in range(8)]
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    trainer.fit(model, torch.utils.data.DataLoader(rows, batch_size=4))
    model.eval()  # GPT-2's dropout
    batch = {"input_ids": ids[:4], "attention_mask": torch.ones(4, 8, dtype=torch.long)}
    expected = model.hf_model(**batch, labels=batch["input_ids"]).loss
    torch.testing.assert_close(model.pipeline_loss(model(ids[:4], batch["attention_mask"]), batch), expected)


def test_other_stages_parameters_refuse_to_be_read_with_the_way_out():
    """A callback walking pl_module.parameters() meets other stages' placeholders: shapes and meta-only ops work,
    reading values (directly or from a result) or mixing with real tensors names the fix."""
    from lightning_pd2bw.engine.materialize import release

    layer = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    release(layer)
    weight = layer[0].weight
    assert weight.shape == (4, 3) and sum(p.numel() for p in layer.parameters()) == 12 + 4 + 4 + 4
    assert layer.state_dict().keys() == {"0.weight", "0.bias", "1.weight", "1.bias"}
    for read in (
        lambda: weight.norm().item(),
        lambda: float(weight.abs().sum()),
        lambda: weight * torch.ones(4, 3),
        lambda: weight.detach().to("cpu"),
    ):
        with pytest.raises(RuntimeError, match=r"another pipeline stage runs.*trainer\.strategy\.stage_parameters\(\)"):
            read()


@pytest.mark.parametrize("family", ["gpt2", "bert"])
def test_trained_weights_export_to_hugging_face(tmp_path, family):
    """A consolidated state dict (this module's names) written as a Hugging Face model loads with
    from_pretrained and computes the same logits; tied weights stay tied."""
    transformers = pytest.importorskip("transformers")
    from lightning_pd2bw.models.hf import HFCausalLM, HFMaskedLM

    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
        kind, auto = HFCausalLM, transformers.AutoModelForCausalLM
    else:
        config = transformers.BertConfig(
            num_hidden_layers=2, hidden_size=16, num_attention_heads=2, intermediate_size=32, vocab_size=32
        )
        kind, auto = HFMaskedLM, transformers.AutoModelForMaskedLM
    trained = kind(config)
    trained.configure_model()
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # "training"
    kind(config).save_pretrained(str(tmp_path), trained.state_dict())
    loaded = auto.from_pretrained(str(tmp_path)).eval()
    trained.eval()
    ids = torch.randint(0, 32, (2, 8))
    torch.testing.assert_close(loaded(ids).logits, trained(ids))
    assert loaded.get_input_embeddings().weight is loaded.get_output_embeddings().weight


def test_seeded_init_ignores_the_default_device():
    """Lightning's single-device strategy runs ``configure_model`` under ``torch.device(root_device)``: the seeded
    initialisation draws on its CPU generator's device (found on an H100: plain Lightning could not build our GPT).
    The meta device stands in for CUDA here: under it, the draws would have no data."""
    from lightning_pd2bw.models import GPT, GPTConfig

    reference, model = GPT(GPTConfig()), GPT(GPTConfig())
    reference.configure_model()
    model.configure_model()
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
    with torch.device("meta"):
        for index in range(len(model.layers)):
            model.init_pipeline_layer(index)
    for (name, expected), got in zip(reference.state_dict().items(), model.state_dict().values()):
        assert torch.equal(expected, got), name


@pytest.mark.parametrize("family", ["gpt", "bert"])
def test_plain_cores_are_the_lightning_models_layers(family):
    """GPTCore/BERTCore (plain nn.Module, models/core.py) build the same layers with the same weights and keys as
    the LightningModules, and compute the same loss."""
    from lightning_pd2bw.models import BERT, GPT, BERTConfig, BERTCore, GPTConfig, GPTCore

    config_cls, core_cls, module_cls = (GPTConfig, GPTCore, GPT) if family == "gpt" else (BERTConfig, BERTCore, BERT)
    config = config_cls.from_name("tiny", n_layer=2)
    core, module = core_cls(config), module_cls(config)
    module.configure_model()
    ours, theirs = core.state_dict(), module.state_dict()
    assert list(ours) == list(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    batch = {"input_ids": torch.randint(0, 256, (2, 16)), "labels": torch.randint(0, 256, (2, 16))}
    assert torch.equal(core.pipeline_loss(core(batch["input_ids"]), batch), module.training_step(batch, 0))
    with pytest.raises(ValueError, match="valid names: bert_base, bert_large, small, tiny"):
        BERTConfig.from_name("gpt2")


class TitanBlock(nn.Module):
    """torchtitan's shape: modules without reset_parameters semantics of their own; ``init_weights()`` sets a
    depth-scaled standard deviation (what torchtitan calls after materialising a meta model)."""

    def __init__(self, width: int, depth_index: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(width, width, bias=False)
        self.std = 0.02 / (2 * (depth_index + 1)) ** 0.5

    def init_weights(self) -> None:
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=self.std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w1(x)


class TitanModel(nn.Module):
    """torchtitan's Transformer shape: ``init_weights()`` at the top, the output at dim**-0.5, blocks scaled."""

    def __init__(self, width: int = 16, vocab: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(TitanBlock(width, i) for i in range(depth))
        self.output = nn.Linear(width, vocab, bias=False)

    def init_weights(self) -> None:
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers:
            layer.init_weights()
        nn.init.trunc_normal_(self.output.weight, std=self.output.in_features**-0.5)


def test_torchtitans_init_weights_protocol_is_honoured():
    """Issue 48: a model with ``init_weights()`` built on the meta device gets its own initialisation, as torchtitan
    gives it (before: nn.Linear's default, std 0.14 here instead of 0.01 and 0.25, silently)."""
    plain = TitanModel()
    torch.manual_seed(0)
    plain.init_weights()  # what torchtitan does on one device (the constructor's draws do not count)
    with parameters_on_meta():
        meta = TitanModel()
    layers = [meta.tok_embeddings, *meta.layers, meta.output]
    assert materialize(layers, torch.device("cpu"))
    torch.manual_seed(0)
    initialize_layers(layers, range(len(layers)), meta, None)
    check_initialized(layers, range(len(layers)), by_init_layer=False)
    for (name, expected), (_, got) in zip(plain.named_parameters(), meta.named_parameters(), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=name)
    assert meta.output.weight.std() < 0.3 and meta.layers[1].w1.weight.std() < 0.015  # nn.Linear: 0.14


def test_init_weights_on_one_stage_of_the_pipeline():
    """A stage holding only the output layer: the top-level ``init_weights()`` runs with the other layers as meta
    placeholders and writes exactly the output's initialisation."""
    from lightning_pd2bw.engine.materialize import release

    with parameters_on_meta():
        meta = TitanModel()
    layers = [meta.tok_embeddings, *meta.layers, meta.output]
    for layer in layers[:-1]:
        release(layer)
    assert materialize(layers[-1:], torch.device("cpu"))
    initialize_layers(layers, [len(layers) - 1], meta, None)
    check_initialized(layers, [len(layers) - 1], by_init_layer=False)
    assert abs(meta.output.weight.std().item() - 16**-0.5) < 0.05


class DuckTypedGPT(nn.Module):
    """litgpt's shape: a ``config`` and an ``_init_weights`` that its constructor never calls. Not a Hugging Face
    model: each module's own ``reset_parameters`` initialises it, as on one device."""

    def __init__(self) -> None:
        super().__init__()
        self.config = {"n_embd": 8}
        self.wte = nn.Embedding(10, 8)
        self.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 10)

    def _init_weights(self, module: nn.Module) -> None:
        raise AssertionError("not a transformers model: its _init_weights is not the initialisation on one device")


def test_a_model_is_taken_for_hugging_face_by_type_only():
    torch.manual_seed(0)
    plain = DuckTypedGPT()
    with parameters_on_meta():
        meta = DuckTypedGPT()
    layers = [meta.wte, meta.norm, meta.lm_head]
    assert materialize(layers, torch.device("cpu"))
    torch.manual_seed(0)
    initialize_layers(layers, range(3), meta, None)
    check_initialized(layers, range(3), by_init_layer=False)
    for (name, expected), (_, got) in zip(plain.named_parameters(), meta.named_parameters(), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=name)
