"""``pd2bw-consolidate CKPT OUT --format hf``: our GPT, trained under the pipeline strategy, loads into
``transformers``' ``GPT2LMHeadModel`` (nothing downloaded) and gives our logits to float32 rounding."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_pd2bw import PipeDream2BWStrategy
from lightning_pd2bw.checkpoint import store as ckpt
from lightning_pd2bw.cli.consolidate import main as consolidate_main
from lightning_pd2bw.data import LMDataset
from lightning_pd2bw.models import BERT, GPT, BERTConfig, GPTConfig
from lightning_pd2bw.models.gpt2_export import gpt2_state_dict

transformers = pytest.importorskip("transformers")
SEQ = 16


def trained_checkpoint(tmp_path, model: pl.LightningModule):
    trainer = pl.Trainer(
        strategy=PipeDream2BWStrategy(num_stages=1, num_microbatches=2, failure_timeout=None),
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = LMDataset(torch.randint(0, 256, (4 * SEQ * 8,), dtype=torch.uint8), SEQ)
    trainer.fit(model, DataLoader(data, batch_size=4, drop_last=True))
    path = tmp_path / "trained.ckpt"
    trainer.save_checkpoint(path)
    return path


def test_gpt_exports_to_gpt2_with_the_same_logits(tmp_path, capsys):
    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=SEQ)
    path = trained_checkpoint(tmp_path, GPT(config, lr=1e-2))
    consolidate_main([str(path), str(tmp_path / "hf"), "--format", "hf"])
    assert "GPT2LMHeadModel.from_pretrained" in capsys.readouterr().out
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "model.safetensors").is_file()

    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ours = GPT(config)
    ours.configure_model()
    ours.load_state_dict(ckpt.consolidate(path))
    ours.eval()
    untrained = GPT(config)
    untrained.configure_model()
    moved = max((a - b).abs().max().item() for a, b in zip(ours.state_dict().values(), untrained.state_dict().values()))
    assert moved > 1e-3, "the exported weights are the trained ones"
    tokens = torch.randint(0, 256, (3, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ours(tokens)
        got = theirs(tokens).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert theirs.lm_head.weight.data_ptr() == theirs.transformer.wte.weight.data_ptr(), "the head stays tied"


def gpt2_directory(tmp_path, activation: str, n_layer: int = 2):
    """A GPT-2 that ``transformers`` builds and saves itself (random weights; nothing downloaded)."""
    torch.manual_seed(4)
    config = transformers.GPT2Config(
        vocab_size=256,
        n_positions=SEQ,
        n_embd=32,
        n_layer=n_layer,
        n_head=2,
        activation_function=activation,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,  # weights large enough for the GELUs to differ
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(tmp_path / "gpt2")
    return tmp_path / "gpt2", model


@pytest.mark.parametrize("gelu, activation", [("tanh", "gelu_new"), ("exact", "gelu")])
def test_our_gpt_started_from_a_gpt2_directory_gives_its_logits(tmp_path, gelu, activation):
    """``init_from=`` a Hugging Face GPT-2 directory into our GPT: the same function as ``GPT2LMHeadModel``
    (its tanh GELU, ``gelu_new``, is ``model.config.gelu=tanh``) to float32 rounding."""
    from lightning_pd2bw.lightning.init_from import initialise

    directory, theirs = gpt2_directory(tmp_path, activation)
    ours = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=SEQ, gelu=gelu))
    ours.configure_model()
    assert initialise(directory, ours, ours.state_dict()) == len(list(ours.named_parameters(remove_duplicate=False)))
    ours.eval()
    tokens = torch.randint(0, 256, (3, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(tokens).logits
        # float32 rounding through 2 blocks moves logits of size ~5 by ~1e-6; the other GELU moves them by ~1e-3
        torch.testing.assert_close(ours(tokens), expected, rtol=0, atol=1e-4)
        for block in ours.layers[1:3]:
            block.approximate = "none" if gelu == "tanh" else "tanh"
        assert (ours(tokens) - expected).abs().max() > 5e-4, "the GELU is told apart at these weights"


def test_a_gpt2_directory_our_gpt_cannot_compute_is_refused_with_the_key_to_set(tmp_path):
    from lightning_pd2bw.lightning.init_from import InitFromError, initialise

    directory, _ = gpt2_directory(tmp_path, "gelu_new")
    exact = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=SEQ))
    exact.configure_model()
    with pytest.raises(
        InitFromError, match=r"init_from=.*gpt2.*activation_function='gelu_new'.*model.config.gelu=tanh"
    ):
        initialise(directory, exact, exact.state_dict())
    deeper = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=SEQ, gelu="tanh"))
    deeper.configure_model()
    with pytest.raises(InitFromError, match="n_layer=2; set model.config.n_layer"):
        initialise(directory, deeper, deeper.state_dict())
    bert = BERT(BERTConfig(n_layer=2, n_head=2, n_embd=32, block_size=SEQ))
    bert.configure_model()
    with pytest.raises(InitFromError, match="not BERT"):
        initialise(directory, bert, bert.state_dict())
    with pytest.raises(ValueError, match="model.config.gelu='erf' is not valid; valid: exact, tanh"):
        GPTConfig(gelu="erf")


def test_a_model_that_is_not_our_gpt_is_refused_by_name():
    bert = BERT(BERTConfig(n_layer=1, n_head=2, n_embd=16, block_size=SEQ))
    bert.configure_model()
    with pytest.raises(ValueError, match="--format hf exports lightning_pd2bw.models.GPT.*save_pretrained"):
        gpt2_state_dict(bert.state_dict(), n_layer=1)
