"""Bring your own model: an unmodified Hugging Face model (built from a config, nothing downloaded) under
strategy="pd2bw" (2 CPU processes, Lightning launches them).

    python examples/hf_models.py gpt2      # or: llama, bert; several train one after another: gpt2 llama bert
"""

import sys

import lightning.pytorch as pl
import torch
import transformers

from lightning_pd2bw.data import read_corpus
from lightning_pd2bw.models.hf import HFCausalLM, HFMaskedLM

VOCAB, SEQ = 128, 32
CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ),
    "llama": lambda: transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=VOCAB
    ),
    "bert": lambda: transformers.BertConfig(
        num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=VOCAB
    ),
}


def data(family):
    """The embedded corpus as ASCII token ids (bytes below 128; a uniform guess scores ln 128 = 4.85), and, for
    BERT, masked-LM labels: every fourth token predicted."""
    text = read_corpus(max_bytes=64 * SEQ * 8).long()
    ids = text[text < VOCAB][: 512 * SEQ].view(-1, SEQ)
    rows = []
    for row in ids:
        sample = {"input_ids": row, "attention_mask": torch.ones(SEQ, dtype=torch.long)}
        if family == "bert":
            sample["labels"] = torch.where(torch.arange(SEQ) % 4 == 0, row, -100)
        rows.append(sample)
    return torch.utils.data.DataLoader(rows, batch_size=8, drop_last=True)


def train(family):
    kind = HFMaskedLM if family == "bert" else HFCausalLM
    model = kind(CONFIGS[family](), lr=1e-3)
    trainer = pl.Trainer(strategy="pd2bw", accelerator="cpu", devices=2, max_steps=30, logger=False)
    trainer.fit(model, data(family))
    print(f"{family}: final train_loss {trainer.callback_metrics['train_loss'].item():.4f}")


if __name__ == "__main__":
    for family in sys.argv[1:] or ["gpt2"]:
        train(family)
