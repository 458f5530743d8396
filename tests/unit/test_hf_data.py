"""Local Hugging Face data: a dataset saved to disk and a tokenizer.json, both built here from the
embedded corpus (nothing is downloaded), feed the LM datamodule and a short training run."""

from __future__ import annotations

import datasets  # noqa: E402  (the [hf] extra, installed by `make test`)
import lightning.pytorch as pl
import pytest
import tokenizers  # noqa: E402
import torch

from lightning_pd2bw.data import TextDataModule, read_corpus
from lightning_pd2bw.models import GPT, GPTConfig


@pytest.fixture(scope="module")
def local_hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    text = bytes(read_corpus(max_bytes=120_000).tolist()).decode("utf-8", errors="replace")
    documents = [d for d in text.split("\n\n") if d.strip()]
    datasets.Dataset.from_dict({"content": documents}).save_to_disk(str(root / "dataset"))
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]"])
    tokenizer.train_from_iterator(documents, trainer)
    tokenizer.save(str(root / "tokenizer.json"))
    return root, documents, tokenizer


def test_dataset_and_tokenizer_give_the_token_stream(local_hf):
    root, documents, tokenizer = local_hf
    data = TextDataModule(
        seq_len=32, batch_size=4, hf_dataset=str(root / "dataset"), text_column="content", tokenizer=str(root)
    )
    ids = data.corpus()
    expected = [i for e in tokenizer.encode_batch(documents) for i in e.ids]
    assert ids.tolist() == expected and ids.max() < 300
    raw = TextDataModule(seq_len=32, batch_size=4, hf_dataset=str(root / "dataset"), text_column="content")
    assert bytes(raw.corpus().tolist()).decode() == "\n".join(documents)[: len(raw.corpus())]


def test_training_on_local_hf_data_lowers_the_loss(local_hf):
    root, _, _ = local_hf
    torch.manual_seed(0)
    kwargs = dict(hf_dataset=str(root / "dataset"), text_column="content", tokenizer=str(root))
    data = TextDataModule(seq_len=32, batch_size=8, **kwargs)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=320), lr=1e-2)
    trainer = pl.Trainer(
        max_steps=60,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=4,
        val_check_interval=60,
    )
    initial = trainer.validate(model, data, verbose=False)[0]["val_loss"]
    trainer.fit(model, data)
    assert trainer.callback_metrics["val_loss"] < initial - 0.3, "training on the token stream learns"


def test_missing_column_and_path_name_the_key(local_hf):
    root, _, _ = local_hf
    with pytest.raises(KeyError, match="data.text_column='text' is not a column .* columns: content"):
        TextDataModule(hf_dataset=str(root / "dataset")).corpus()
    with pytest.raises(FileNotFoundError, match="data.hf_dataset='/nowhere' does not exist"):
        TextDataModule(hf_dataset="/nowhere").corpus()
    with pytest.raises(ValueError, match="data.tokenizer with data.task=mlm"):
        TextDataModule(task="mlm", tokenizer=str(root))
