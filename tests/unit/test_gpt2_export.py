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


def test_a_model_that_is_not_our_gpt_is_refused_by_name():
    bert = BERT(BERTConfig(n_layer=1, n_head=2, n_embd=16, block_size=SEQ))
    bert.configure_model()
    with pytest.raises(ValueError, match="--format hf exports lightning_pd2bw.models.GPT.*save_pretrained"):
        gpt2_state_dict(bert.state_dict(), n_layer=1)
