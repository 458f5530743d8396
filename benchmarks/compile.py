"""``compile=True`` against eager, side by side in the same processes: tokens/s of the pipeline engine.

    python benchmarks/compile.py                         # 2 CPU processes x 1 thread, 2bw and flush, ~4 min here
    python benchmarks/compile.py --procs 4 --modes 2bw   # depth 4
    python benchmarks/compile.py --layers 8 --width 384 --rounds 9

Each process of a ``torchrun`` job builds two engines over the same GPT (``--layers`` x ``--width``, seq 128,
microbatches of 4 sequences, m = 4), one eager and one with ``compile=True`` (inductor, per layer), and trains them
in alternating rounds of ``--steps`` batches after a warm-up (compilation): the ratio of each round pair is taken
side by side, so that the machine's drift does not favour either. Prints tokens/s, the per-round ratios and their
median, and the compiled engine's graphs and recompilations after warm-up. The engine runs without Lightning.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEQ, MICRO, M = 128, 4, 4


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from lightning_pd2bw.engine import PipelineEngine, PipelineOptions
    from lightning_pd2bw.engine.materialize import parameters_on_meta
    from lightning_pd2bw.models import GPTConfig, GPTCore

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (M * MICRO, SEQ + 1), generator=generator)
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    report = {}
    for mode in args.modes.split(","):
        engines = {}
        for kind in ("eager", "compiled"):
            with parameters_on_meta():
                model = GPTCore(GPTConfig(n_layer=args.layers, n_head=8, n_embd=args.width, block_size=SEQ))
            engine = PipelineEngine(
                model.pipeline_layers(),
                PipelineOptions(num_microbatches=M, mode=mode, compile=kind == "compiled"),
                model.pipeline_inputs,
                model.pipeline_loss,
                device="cpu",
                init_layer=model.init_pipeline_layer,
            )
            engine.start(torch.optim.AdamW(engine.parameters(), lr=1e-4, foreach=True))
            engines[kind] = engine
        seconds: dict[str, list[float]] = {"eager": [], "compiled": []}
        warmup = {}
        for kind, engine in engines.items():  # warm-up: compilation, both weight versions
            start = time.perf_counter()
            for _ in range(3):
                engine.train_batch(batch)
            dist.barrier()
            warmup[kind] = time.perf_counter() - start
        for _ in range(args.rounds):
            for kind, engine in engines.items():
                dist.barrier()
                start = time.perf_counter()
                for _ in range(args.steps):
                    engine.train_batch(batch)
                dist.barrier()
                seconds[kind].append(time.perf_counter() - start)
        for engine in engines.values():
            engine.drain()
        tokens_per_round = args.steps * M * MICRO * SEQ
        ratios = [e / c for e, c in zip(seconds["eager"], seconds["compiled"])]
        report[mode] = {
            "eager_tokens_per_sec": tokens_per_round / statistics.median(seconds["eager"]),
            "compiled_tokens_per_sec": tokens_per_round / statistics.median(seconds["compiled"]),
            "ratios": ratios,
            "median_ratio": statistics.median(ratios),
            "warmup_seconds": warmup,
            "counters": engines["compiled"].compile_meter.counters(),
        }
        for engine in engines.values():
            engine.close()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, report)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, default=2, help="processes = pipeline depth")
    parser.add_argument("--modes", default="2bw,flush")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--rounds", type=int, default=7, help="alternating timed rounds per engine")
    parser.add_argument("--steps", type=int, default=3, help="batches per round")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    out = Path("/tmp") / f"pd2bw-compile-bench-{os.getpid()}.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    forwarded = [f"--{k}={v}" for k, v in vars(args).items() if k in ("modes", "layers", "width", "rounds", "steps")]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.procs}"]
    subprocess.run([*command, __file__, "--worker", f"--out={out}", *forwarded], env=env, check=True)
    ranks = json.loads(out.read_text())
    print(
        f"GPT {args.layers} x {args.width}, seq {SEQ}, m = {M} x {MICRO} sequences, depth {args.procs}, 1 thread each"
    )
    print(f"{'mode':>6} | eager tok/s | compiled tok/s | compiled / eager (median; per round) | graphs | recompiles")
    for mode in ranks[0]:
        r = ranks[0][mode]
        slowest = min(rank[mode]["median_ratio"] for rank in ranks)
        graphs = sum(rank[mode]["counters"]["compile/graphs"] for rank in ranks)
        recompiles = sum(rank[mode]["counters"]["compile/recompiles_after_warmup"] for rank in ranks)
        rounds = ", ".join(f"{x:.3f}" for x in r["ratios"])
        print(
            f"{mode:>6} | {r['eager_tokens_per_sec']:11.0f} | {r['compiled_tokens_per_sec']:14.0f} | "
            f"{r['median_ratio']:.3f} (rank 0; slowest rank {slowest:.3f}; {rounds}) | {graphs} | {recompiles}"
        )
        print(
            f"{'':>6}   warm-up (3 batches): eager {r['warmup_seconds']['eager']:.1f} s, compiled "
            f"{r['warmup_seconds']['compiled']:.1f} s (inductor's compilation, its on-disk cache warm or cold)"
        )


if __name__ == "__main__":
    main()
