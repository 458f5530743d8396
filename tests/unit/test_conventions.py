"""Lightning's conventions for getting a model back: ``pd2bw-consolidate PATH model.ckpt`` then
``Model.load_from_checkpoint("model.ckpt")`` returns the trained module (GPT, BERT, the Hugging Face wrappers); the
GPT-2 export names only token ids its vocabulary has; a tuple crossing between layers that the next layer cannot
take is refused naming the layer."""

from __future__ import annotations

import json

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_pd2bw import PipeDream2BWStrategy
from lightning_pd2bw.checkpoint import store as ckpt
from lightning_pd2bw.cli.consolidate import main as consolidate_main
from lightning_pd2bw.engine.executor import StageExecutor
from lightning_pd2bw.engine.layout import Layout
from lightning_pd2bw.engine.state.versions import WeightVersions
from lightning_pd2bw.models import BERT, GPT, BERTConfig, GPTConfig

SEQ, VOCAB = 12, 64


class Tokens(Dataset):
    """Random rows; masked ones predict every fourth token (-100 elsewhere), causal ones the next token."""

    def __init__(self, masked: bool, count: int = 32) -> None:
        self.ids = torch.randint(0, VOCAB, (count, SEQ + 1), generator=torch.Generator().manual_seed(3))
        self.masked = masked

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self.masked:
            labels = torch.full((SEQ,), -100)
            labels[::4] = self.ids[i, :SEQ][::4]
            return {"input_ids": self.ids[i, :SEQ], "labels": labels}
        return {"input_ids": self.ids[i, :SEQ], "labels": self.ids[i, 1:]}


def ours(masked: bool) -> pl.LightningModule:
    if masked:
        return BERT(BERTConfig(n_layer=2, n_head=2, n_embd=16, block_size=SEQ, vocab_size=VOCAB), lr=1e-2)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=SEQ, vocab_size=VOCAB), lr=1e-2)


def hugging_face(masked: bool) -> pl.LightningModule:
    pytest.importorskip("transformers")
    from lightning_pd2bw.models.hf import HFCausalLM, HFMaskedLM

    from ..distributed.hf_models import SEQ as HF_SEQ
    from ..distributed.hf_models import VOCAB as HF_VOCAB
    from ..distributed.hf_models import config

    assert (HF_SEQ, HF_VOCAB) == (SEQ, VOCAB)
    return HFMaskedLM(config("bert"), lr=1e-2) if masked else HFCausalLM(config("gpt2"), lr=1e-2)


MODELS = {
    "gpt": (GPT, lambda: ours(False), False),
    "bert": (BERT, lambda: ours(True), True),
    "hf_gpt2": (None, lambda: hugging_face(False), False),
    "hf_bert": (None, lambda: hugging_face(True), True),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_load_from_checkpoint_of_a_consolidated_run_returns_the_trained_module(tmp_path, name):
    _, build, masked = MODELS[name]
    torch.manual_seed(0)
    model = build()
    cls = type(model)
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
    trainer.fit(model, DataLoader(Tokens(masked), batch_size=4, drop_last=True))
    sharded = tmp_path / "trained.ckpt"
    trainer.save_checkpoint(sharded)
    consolidate_main([str(sharded), str(tmp_path / "model.ckpt")])

    loaded = cls.load_from_checkpoint(tmp_path / "model.ckpt")  # Lightning's documented way back

    trained = ckpt.consolidate(sharded)
    state = loaded.state_dict()
    assert set(state) == set(trained)
    for key, value in trained.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0)
    fresh = build()
    fresh.configure_model()
    moved = max((trained[k] - v).abs().max().item() for k, v in fresh.state_dict().items())
    assert moved > 1e-3, "the checkpoint holds trained weights, not a fresh initialisation"
    batch = next(iter(DataLoader(Tokens(masked), batch_size=3)))
    fresh.load_state_dict(trained)
    loaded.eval(), fresh.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(batch["input_ids"]), fresh(batch["input_ids"]), rtol=0, atol=0)
    assert loaded.hparams.lr == 1e-2


def test_gpt2_export_names_token_ids_inside_the_vocabulary(tmp_path):
    pytest.importorskip("transformers")
    from lightning_pd2bw.models.gpt2_export import save_gpt2

    for vocab, expected in ((256, None), (50304, 50256)):
        config = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=SEQ, vocab_size=vocab)
        model = GPT(config)
        model.configure_model()
        out = save_gpt2(tmp_path / f"v{vocab}", model.state_dict(), vars(config))
        written = json.loads((out / "config.json").read_text())
        assert written["vocab_size"] == vocab
        assert written.get("bos_token_id") == expected and written.get("eos_token_id") == expected


class Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x + 1, x > 0


class TakesTwo(nn.Module):
    def forward(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return hidden * mask


class TakesOne(nn.Module):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


def _stage(*layers: nn.Module) -> StageExecutor:
    return StageExecutor(
        list(layers), 0, Layout(1, 1), None, WeightVersions([], False), lambda b: b, lambda o, b: o.sum()
    )


def test_a_tuple_reaches_the_next_layer_as_positional_arguments():
    x = torch.tensor([-1.0, 2.0])
    torch.testing.assert_close(_stage(Pair(), TakesTwo()).run_layers((x,)), torch.tensor([0.0, 3.0]))


def test_a_layer_that_cannot_take_the_tuple_is_named_with_the_fix():
    with pytest.raises(
        TypeError,
        match=r"layer 1 of stage 0 \(TakesOne\.forward\(hidden.*tuple of 2 values.*forward\(self, hidden, mask\)",
    ):
        _stage(Pair(), TakesOne()).run_layers((torch.ones(2),))
