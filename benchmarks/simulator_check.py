"""The planner's simulator against measured steps, with the costs taken from the same run.

    python benchmarks/simulator_check.py

``benchmarks/planner_accuracy.py`` predicts from a per-layer profile, whose noise on a shared 2-core machine
moves the prediction more than the model does. This benchmark checks the simulator itself: each configuration
trains under ``torchrun`` (2 CPU processes, one thread each, a GPT of 6 x 256, seq 128, global batch 16) with
``PipelineTrace``; from the trace's own spans it takes, per stage, the median forward and backward, the update's
compute, the fastest receive (a message's cost once it has arrived) and the host's work per action and per step (the
gaps between spans); the simulator (``planner/simulate.py``) then runs the engine's action lists with those costs,
and its step time is set beside the measured median step. What differs is what the simulator gets wrong about
where the engine waits.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEQ, GLOBAL_BATCH, FIRST, TRACED = 128, 16, 2, 6
CONFIGS = [(mode, m, clip) for mode in ("2bw", "flush") for m in (2, 4, 8) for clip in (False, True)]


def worker(out: Path, mode: str, m: int, clip: bool, picture: bool = False, stages: int = 2) -> None:
    """One traced run over ``stages`` processes (a GPT of 6 x 256; 2 layers a stage more where ``stages`` > 2, so
    interleaved 1F1B's 2 chunks a stage get a layer each)."""
    import torch

    torch.set_num_threads(1)
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_pd2bw import PipeDream2BWStrategy
    from lightning_pd2bw.data import LMDataset, read_corpus
    from lightning_pd2bw.lightning.trace import PipelineTrace
    from lightning_pd2bw.models import GPT, GPTConfig

    class StepTimer(pl.Callback):
        marks: list[float] = []

        def on_train_batch_end(self, *args: object) -> None:
            self.marks.append(time.perf_counter())

    pl.seed_everything(0)
    model = GPT(GPTConfig(n_layer=max(6, 2 * stages), n_head=4, n_embd=256, block_size=SEQ), lr=1e-3)
    data = LMDataset(read_corpus(max_bytes=2_000_000), SEQ)
    timer = StepTimer()
    trainer = pl.Trainer(
        strategy=PipeDream2BWStrategy(num_stages=stages, num_microbatches=m, mode=mode),
        accelerator="cpu",
        devices=stages,
        max_steps=FIRST + TRACED,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        gradient_clip_val=1.0 if clip else None,
        callbacks=[timer, PipelineTrace(dirpath=str(out), first_step=FIRST, num_steps=TRACED, picture=picture)],
    )
    trainer.fit(model, DataLoader(data, batch_size=GLOBAL_BATCH, shuffle=True))
    steps = [b - a for a, b in zip(timer.marks[FIRST:], timer.marks[FIRST + 1 :])]
    (out / f"steps-{trainer.global_rank}.json").write_text(json.dumps(steps))


def costs_from(trace: dict, mode: str, m: int, clip: bool):
    """Each stage's ``StageCosts`` from its spans (seconds); interleaved 1F1B: each virtual stage's (a stage's chunk,
    its spans by their ``chunk``; the update's once, on the first chunk)."""
    from lightning_pd2bw.engine.updates.update import UpdateShape
    from lightning_pd2bw.planner.simulate import StageCosts

    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    receives = [e["dur"] for e in spans if e["cat"] in ("RECV_F", "RECV_B")]
    message = min(receives) / 1e6
    chunks = 2 if mode == "interleaved" else 1
    costs = []
    for virtual in range(2 * chunks):
        stage, chunk = virtual % 2, virtual // 2
        mine = sorted((e for e in spans if e["pid"] == stage), key=lambda e: e["ts"])

        def median(kind: str, mine: list = mine, chunk: int = chunk) -> float:
            found = [e["dur"] / 1e6 for e in mine if e["cat"] == kind and e["args"].get("chunk", 0) == chunk]
            return statistics.median(found) if found else 0.0

        pairs = list(zip(mine, mine[1:]))
        gaps = [(b["ts"] - a["ts"] - a["dur"]) / 1e6 for a, b in pairs]
        dispatch = statistics.median(gaps)
        between = [gap for gap, (a, _) in zip(gaps, pairs) if a["cat"] == "LOSS"]  # a step's end to the next one's
        per_step = max(0.0, statistics.median(between) - dispatch) if between else 0.0
        weight = median("W")  # zb_h1's deferred weight gradients (0 where the backward is not split)
        costs.append(
            StageCosts(
                median("F"),
                median("B") + weight,
                send=message,
                step=median("STEP"),
                read_gradients=median("NORM") if clip else median("CHECK"),
                shape=UpdateShape(mode == "2bw", clip="global" if clip else None),
                dispatch=dispatch,
                per_step=per_step,
                weight_grad=weight,
            )
        )
    return costs


def main() -> None:
    from lightning_pd2bw.engine.layout import Layout
    from lightning_pd2bw.planner.simulate import simulate

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (mode, m, clip) in enumerate(CONFIGS):
            out = Path(tmp) / str(i)
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node=2",
                __file__,
                "--worker",
                str(out),
                mode,
                str(m),
                str(int(clip)),
            ]
            result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
            if result.returncode:
                raise SystemExit(result.stderr[-4000:])
            trace = json.loads((out / "trace.json").read_text())
            measured = statistics.median(json.loads((out / "steps-0.json").read_text()))
            costs = costs_from(trace, mode, m, clip)
            simulated = simulate(Layout(2, m, mode), costs, lambda stage, collective: 0.0).step_time
            rows.append((mode, m, clip, simulated, measured, costs))
            print(f"{mode:>5} m={m} clip={'on' if clip else 'off'}: simulated {simulated * 1e3:.1f} ms, "
                  f"measured {measured * 1e3:.1f} ms ({simulated / measured - 1:+.1%})", flush=True)  # fmt: skip
    print("| mode | m | clip | simulated step ms | measured step ms | error | F / B ms (stage 0, 1) | dispatch ms |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, m, clip, simulated, measured, costs in rows:
        fb = ", ".join(f"{c.forward * 1e3:.1f} / {c.backward * 1e3:.1f}" for c in costs)
        print(
            f"| {mode} | {m} | {'on' if clip else 'off'} | {simulated * 1e3:.1f} | {measured * 1e3:.1f} | "
            f"{simulated / measured - 1:+.1%} | {fb} | {costs[0].dispatch * 1e3:.2f} |"
        )
    worst = max(abs(s / m - 1) for *_, s, m, _ in rows)
    print(f"largest error {worst:.1%} (target 10%)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), bool(int(sys.argv[5])))
    else:
        main()
