"""Two settings of the engine, alternated in one process group: a paired A/B that this machine's drift cannot fake.

    torchrun --standalone --nproc-per-node=2 benchmarks/engine_ab.py '{"lookahead": 1}'
    torchrun --standalone --nproc-per-node=2 benchmarks/engine_ab.py '{"lookahead": 1}' --base '{"mode": "2bw"}' \\
        --rounds 12 --steps 6 --microbatches 4

A setting is ``PipelineOptions`` keys (``mode``, ``lookahead``, ``recompute``, ``boundary_dtype`` as a name,
``num_microbatches``: the same batch of ``--m`` x 4 sequences cut into that many microbatches, ...) and the engine's
``clip_val`` and ``clip_algorithm``, over ``--base`` (default: 2BW, no clipping). Each round trains A and
B, in the order A B, B A, A B, ... so that a steady drift of the machine favours neither, each a fresh engine on the
same initial weights and the same batches (the benchmark GPT of ``pipelines_run.py``: 8 x 384, seq 128, microbatches
of 4 sequences, depth = processes, embedding and head on the end stages): one untimed step, then ``--steps`` timed
steps and the drain, between two barriers. This machine's speed moves by 10-20% within minutes (docs/benchmarks.md: Timelines
and benchmarks), which is the size of the effects worth measuring; a ratio taken within one round, seconds apart,
does not see that. Rank 0 prints each round's samples/s and B/A, then the median ratio and its quartiles.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.pipelines_run import CONFIG, MICRO, even_cut  # noqa: E402
from lightning_pd2bw.data import LMDataset, read_corpus
from lightning_pd2bw.engine import Clipping, PipelineEngine, PipelineOptions
from lightning_pd2bw.engine.materialize import parameters_on_meta
from lightning_pd2bw.models import GPTCore

CLIP_KEYS = {"clip_val": "value", "clip_algorithm": "algorithm"}  # a setting's clipping -> Clipping's fields


def engine_for(setting: dict, depth: int, m: int) -> PipelineEngine:
    with parameters_on_meta():  # each stage materialises (and seeds) only its own layers: the same weights each time
        model = GPTCore(CONFIG)
    layers = model.pipeline_layers()
    setting = {"num_microbatches": m, **setting}  # the batch stays m x MICRO sequences; its microbatches may differ
    options = PipelineOptions(
        num_stages=depth,
        layers_per_stage=tuple(even_cut(len(layers), depth)),
        clipping=Clipping(**{CLIP_KEYS[k]: v for k, v in setting.items() if k in CLIP_KEYS}),
        **{k: v for k, v in setting.items() if k not in CLIP_KEYS},
    )
    engine = PipelineEngine(
        layers, options, model.pipeline_inputs, model.pipeline_loss, init_layer=model.init_pipeline_layer
    )
    engine.start(torch.optim.AdamW(engine.parameters(), lr=1e-4))
    return engine


def timed(setting: dict, batches: list, depth: int, m: int, steps: int) -> float:
    """Samples/s of ``steps`` steps and the drain, after one untimed step."""
    engine = engine_for(setting, depth, m)
    engine.train_batch(batches[0])
    dist.barrier()
    start = time.perf_counter()
    for batch in batches[1 : steps + 1]:
        engine.train_batch(batch)
    engine.drain()
    dist.barrier()
    elapsed = time.perf_counter() - start
    engine.close()
    return steps * m * MICRO / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("setting", help="B, as JSON over --base (e.g. '{\"lookahead\": 1}')")
    parser.add_argument("--base", default="{}", help="A, as JSON (default: 2BW as the engine's defaults)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per engine and round")
    parser.add_argument(
        "--microbatches", type=int, default=4, help="m: the batch is m x 4 sequences, in m microbatches"
    )
    args = parser.parse_args()
    base = json.loads(args.base)
    settings = {"A": base, "B": {**base, **json.loads(args.setting)}}

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    dist.init_process_group("gloo")
    depth, rank = dist.get_world_size(), dist.get_rank()
    data = LMDataset(read_corpus(max_bytes=2_000_000), CONFIG.block_size)
    size = args.microbatches * MICRO
    batches = [
        {k: torch.stack([data[i][k] for i in range(s * size, (s + 1) * size)]) for k in data[0]}
        for s in range(args.steps + 1)
    ]
    if rank == 0:
        print(
            f"A = {settings['A']}, B = {settings['B']}; depth {depth}, m = {args.microbatches}, {args.steps} steps per run"
        )
    ratios = []
    for round_ in range(args.rounds):
        order = "AB" if round_ % 2 == 0 else "BA"
        speed = {name: timed(settings[name], batches, depth, args.microbatches, args.steps) for name in order}
        ratios.append(speed["B"] / speed["A"])
        if rank == 0:
            print(
                f"round {round_ + 1:2d} ({order}): A {speed['A']:6.2f}  B {speed['B']:6.2f} samples/s  B/A {ratios[-1]:.3f}"
            )
    if rank == 0:
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        print(
            f"B/A over {len(ratios)} rounds: median {statistics.median(ratios):.3f} (quartiles {quartiles[0]:.3f} - "
            f"{quartiles[2]:.3f}); B faster in {sum(r > 1 for r in ratios)} of {len(ratios)}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
