"""What ZB-H1's split backward costs one process: a stage's forward and backward undivided, against the same with
``engine/weight_grads.py``'s interception (forward), B (input gradients) and W (weight gradients), side by side.

    python benchmarks/split_cost.py [--rounds 15]

The stage is ``benchmarks/schedules.py``'s model's first (the embedding and 3 blocks of a GPT 6 x 256, seq 128, a
microbatch of 4, one thread). Prints the medians of alternated rounds and the split's cost over the undivided pass:
what the bubble ZB-H1 fills must exceed for it to gain.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lightning_pd2bw.engine.weight_grads import WeightGradients
from lightning_pd2bw.models import GPT, GPTConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=3, n_head=4, n_embd=256, block_size=128), lr=1e-3)
    model.configure_model()
    layers = list(model.pipeline_layers())[:4]  # the embedding and the blocks: no head, no loss
    ids = torch.randint(0, 100, (4, 128))

    def forward() -> torch.Tensor:
        x = ids
        for layer in layers:
            x = layer(x)
        return x.float().pow(2).mean()

    def undivided() -> tuple[float, float, float]:
        start = time.perf_counter()
        loss = forward()
        middle = time.perf_counter()
        loss.backward()
        return middle - start, time.perf_counter() - middle, 0.0

    def split() -> tuple[float, float, float]:
        store = WeightGradients()
        start = time.perf_counter()
        with store.intercept(0):
            loss = forward()
        middle = time.perf_counter()
        loss.backward()
        store.after_backward(0)
        w = time.perf_counter()
        store.compute(0)
        return middle - start, w - middle, time.perf_counter() - w

    runs: dict[str, list[tuple[float, float, float]]] = {"undivided": [], "split": []}
    for round_ in range(args.rounds + 2):
        order = (("undivided", undivided), ("split", split))
        for name, run in order if round_ % 2 == 0 else order[::-1]:  # alternated
            for param in model.parameters():
                param.grad = None
            timed = run()
            if round_ >= 2:  # the first two rounds warm up
                runs[name].append(timed)
    medians = {name: [statistics.median(t[i] for t in rows) * 1e3 for i in range(3)] for name, rows in runs.items()}
    (f, b, _), (sf, sb, sw) = medians["undivided"], medians["split"]
    print(f"medians of {args.rounds} alternated rounds, ms: undivided F {f:.1f}, B {b:.1f}; split F {sf:.1f}, "
          f"B {sb:.1f}, W {sw:.1f}")  # fmt: skip
    print(f"the split over the undivided pass: forward {sf / f:.3f}x, backward (B + W) {(sb + sw) / b:.3f}x, "
          f"both {(sf + sb + sw) / (f + b):.3f}x")  # fmt: skip


if __name__ == "__main__":
    main()
