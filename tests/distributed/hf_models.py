"""Tiny Hugging Face models (random init, nothing downloaded), their data and the single-process reference."""

from __future__ import annotations

import torch
from torch.func import functional_call

from lightning_pd2bw.models.hf import HFCausalLM, HFMaskedLM

STAGES, MICRO, MICROBATCHES, STEPS, VOCAB, SEQ = 2, 2, 2, 4, 64, 12


def config(family: str):
    import transformers

    if family == "gpt2":
        return transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
        )
    if family == "bert":
        return transformers.BertConfig(
            num_hidden_layers=2,
            hidden_size=32,
            num_attention_heads=2,
            intermediate_size=64,
            vocab_size=VOCAB,
            max_position_embeddings=SEQ,
            hidden_dropout_prob=0,
            attention_probs_dropout_prob=0,
        )
    return transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
    )


def build(family: str) -> HFCausalLM:
    # SGD: AdamW would turn the rounding noise of gradients that are zero in exact arithmetic (GPT-2's key bias:
    # softmax ignores a shift) into full-size steps
    kind = HFMaskedLM if family == "bert" else HFCausalLM
    return kind(config(family), optimizer="sgd", lr=0.5, momentum=0.9, weight_decay=0.01)


def samples(family: str, count: int = 64) -> list[dict[str, torch.Tensor]]:
    """Random token ids; Llama's and BERT's rows carry a padding ``attention_mask`` (the last tokens of every third
    row); BERT's carry MLM ``labels``."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (count, SEQ), generator=g)
    rows = [{"input_ids": ids[i]} for i in range(count)]
    if family == "bert":  # masked LM: every fourth token is predicted
        for row in rows:
            row["labels"] = torch.full_like(row["input_ids"], -100)
            row["labels"][::4] = row["input_ids"][::4]
    if family in ("llama", "bert"):
        for i, row in enumerate(rows):
            mask = torch.ones(SEQ, dtype=torch.long)
            if i % 3 == 0:
                mask[-3:] = 0
            row["attention_mask"] = mask
    return rows


def replica_batch(family: str, step: int, replica: int, width: int) -> dict[str, torch.Tensor]:
    """What the training sampler gives replica ``replica`` at ``step`` (epoch 0): Lightning's DistributedSampler,
    shuffled with seed 0."""
    everything = samples(family)
    order = torch.randperm(len(everything), generator=torch.Generator().manual_seed(0)).tolist()
    data = [everything[i] for i in order[replica::width]]
    rows = data[step * MICRO * MICROBATCHES : (step + 1) * MICRO * MICROBATCHES]
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def reference(family: str, mode: str, width: int, initial: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Every weight version W(0) .. W(STEPS), by every parameter name: Gradient accumulation over every microbatch of every replica, one SGD step per batch; 2BW takes the
    gradient at the weights of version max(t-1, 0) and applies it to the newest weights."""
    model = build(family)
    model.configure_model()
    names = dict(model.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters(remove_duplicate=False):
            if name in initial:  # a parameter tied within a stage is saved under one of its names
                param.copy_(initial[name])
    optimizer = model.configure_optimizers()
    history = [{n: p.detach().clone() for n, p in names.items()}]
    for step in range(STEPS):
        version = max(step - 1, 0) if mode == "2bw" else step
        weights = {n: t.clone().requires_grad_() for n, t in history[version].items()}
        grads = {n: torch.zeros_like(t) for n, t in weights.items()}
        for replica in range(width):
            batch = replica_batch(family, step, replica, width)
            for j in range(MICROBATCHES):
                micro = {k: v[j * MICRO : (j + 1) * MICRO] for k, v in batch.items()}
                logits = functional_call(model, weights, (micro["input_ids"], micro.get("attention_mask")))
                loss = model.pipeline_loss(logits, micro) / (width * MICROBATCHES)
                for n, g in zip(weights, torch.autograd.grad(loss, list(weights.values()))):
                    grads[n] += g
        for n, p in names.items():
            p.grad = grads[n]
        optimizer.step()
        optimizer.zero_grad()
        history.append({n: p.detach().clone() for n, p in names.items()})
    aliases = [(n, a) for n, p in model.named_parameters(remove_duplicate=False) for a, q in names.items() if p is q]
    return [{n: weights[a] for n, a in aliases} for weights in history]
