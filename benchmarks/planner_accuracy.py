"""Planner accuracy on this machine: predicted vs measured samples/s and memory per stage.

    python benchmarks/planner_accuracy.py

Each configuration runs ``benchmarks/planner_run.py`` (``REPEATS`` times, interleaved, medians reported) under torchrun (2 CPU processes, one thread
each): the planner's measured profile and link timings give the prediction, then pd2bw trains the
same configuration and is timed (steady-state steps) and its resident-memory growth per rank read.
Prints the table, whether the planner's ranking equals the measured one, and the largest errors.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (width, depth, micro_batch_size, recompute, mode, clip) over 2 processes, global batch 16: d = 2 at m = 2, 4 and 8
# in both modes (GPT ties its embedding to its head: the tied sum runs every update), clipping by the global norm
# on and off, then micro 1, recomputation and two replicas
CONFIGS = [
    *((1, 2, micro, False, mode, clip) for mode in ("2bw", "flush") for micro in (8, 4, 2) for clip in (False, True)),
    (1, 2, 1, False, "2bw", False),
    (1, 2, 4, True, "2bw", False),
    (2, 1, 4, False, "flush", False),  # 2BW at depth 1 is refused: data parallelism is Flush
]
TIE = 0.05  # measured throughputs closer than this are a tie (run-to-run noise here is a few percent)


def run(config: tuple, out: Path) -> list[dict]:
    # a fixed mmap threshold: glibc returns freed large tensors to the OS, so resident memory tracks live tensors
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), MALLOC_MMAP_THRESHOLD_="131072")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(ROOT / "benchmarks" / "planner_run.py"),
        json.dumps(config),
        str(out),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if result.returncode:
        raise SystemExit(result.stderr[-4000:])
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]


REPEATS = 2  # every configuration run this many times, interleaved; the medians are reported


def main() -> None:
    runs: dict[int, list[tuple[float, float, dict]]] = {i: [] for i in range(len(CONFIGS))}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(REPEATS):
            for i, config in enumerate(CONFIGS):
                ranks = run(config, Path(tmp) / f"{i}-{repeat}")
                zero = ranks[0]
                memory = {r["stage"]: (zero["predicted_memory"][r["stage"]], r["measured_memory"]) for r in ranks}
                runs[i].append((zero["predicted_samples_per_sec"], zero["measured_samples_per_sec"], memory))
    rows = []
    for i, config in enumerate(CONFIGS):
        predicted = statistics.median(p for p, _, _ in runs[i])
        measured = statistics.median(m for _, m, _ in runs[i])
        rows.append((config, predicted, measured, runs[i][-1][2]))
    print(
        f"{'width':>5} {'depth':>5} {'micro':>5} {'recompute':>9} {'mode':>5} {'clip':>4} | {'predicted':>9} "
        f"{'measured':>9} "
        f"{'error':>6} | memory per stage MiB: predicted / measured (error)"
    )
    for (w, d, b, r, mode, clip), predicted, measured, memory in rows:
        mem = "  ".join(
            f"s{s}: {p / 2**20:.0f} / {m / 2**20:.0f} ({p / m - 1:+.0%})" for s, (p, m) in sorted(memory.items())
        )
        print(
            f"{w:>5} {d:>5} {b:>5} {'on' if r else 'off':>9} {mode:>5} {'on' if clip else 'off':>4} | "
            f"{predicted:>9.2f} {measured:>9.2f} "
            f"{predicted / measured - 1:>+6.0%} | {mem}"
        )
    by_prediction = sorted(range(len(rows)), key=lambda i: -rows[i][1])
    by_measurement = sorted(range(len(rows)), key=lambda i: -rows[i][2])
    worst_time = max(abs(p / m - 1) for _, p, m, _ in rows)
    worst_memory = max(abs(p / m - 1) for *_, memory in rows for p, m in memory.values())
    inversions = [
        (i, j)
        for i in range(len(rows))
        for j in range(len(rows))
        if rows[i][1] > rows[j][1] and rows[i][2] < rows[j][2] * (1 - TIE)
    ]
    print(
        f"ranking (config index, best first): predicted {by_prediction}, measured {by_measurement}: "
        f"{'same' if by_prediction == by_measurement else 'different'}; pairs the planner orders the wrong way by "
        f"more than {TIE:.0%} measured: {inversions or 'none'}"
    )
    print(
        f"largest throughput error {worst_time:.0%} (target 25%), largest memory error {worst_memory:.0%} (target 20%)"
    )


if __name__ == "__main__":
    main()
