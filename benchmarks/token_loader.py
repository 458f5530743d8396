"""The tokenized-data loader alone against the training step it feeds: is data ever the bottleneck?

    python benchmarks/token_loader.py                       # prepares a corpus from this repository's text
    python benchmarks/token_loader.py --seq 2048 --batch 8  # GPT-13B's windows

Prepares a corpus with ``pd2bw-prepare-data`` (a BPE trained on the spot on the package's own source), then
times ``DataLoader(TokenDataset)`` alone (shuffled, as training reads it; 0 and 2 workers) in samples/s, and
the training step of the benchmark GPT (8 x 384, one process, the same batch) in samples/s. Prints the ratio.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from lightning_pd2bw.data.prepare import prepare
from lightning_pd2bw.data.tokens import TokenDataset
from lightning_pd2bw.models import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]


def loader_rate(data: TokenDataset, batch: int, workers: int, batches: int) -> float:
    loader = DataLoader(
        data, batch, shuffle=True, drop_last=True, num_workers=workers, generator=torch.Generator().manual_seed(0)
    )
    it = iter(loader)
    next(it)  # workers started
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    return batches * batch / (time.perf_counter() - start)


def step_rate(seq: int, batch: int, vocab: int, steps: int = 3) -> float:
    model = GPT(GPTConfig(n_layer=8, n_head=8, n_embd=384, block_size=seq, vocab_size=vocab))
    model.configure_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, vocab, (batch, seq + 1))
    batch_dict = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        model.pipeline_loss(model(batch_dict["input_ids"]), batch_dict).backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return batch / sorted(times[1:])[len(times[1:]) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--batches", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        sources = sorted((ROOT / "lightning_pd2bw").rglob("*.py")) + [ROOT / "README.md"]
        index = prepare(tmp, sources, vocab_size=4096, val_fraction=0.01)
        data = TokenDataset(tmp, args.seq)
        print(
            f"corpus: {index['tokens']:,} tokens, vocabulary {index['vocab_size']}, {len(data):,} windows of {args.seq}"
        )
        rates = {w: loader_rate(data, args.batch, w, min(args.batches, len(data) // args.batch - 2)) for w in (0, 2)}
        step = step_rate(args.seq, args.batch, index["vocab_size"])
    print(f"training step (GPT 8 x 384, 1 thread, batch {args.batch} x {args.seq}): {step:,.1f} samples/s")
    for workers, rate in rates.items():
        print(f"loader alone, {workers} workers: {rate:,.0f} samples/s = {rate / step:,.0f}x the step")


if __name__ == "__main__":
    main()
