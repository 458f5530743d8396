"""The synchronous schedules beside 2BW, measured side by side in one run: plain 1F1B (``flush``), ZB-H1 (``zb_h1``),
interleaved 1F1B (two chunks a stage) and 2BW, at d = 2 over 2 CPU processes, m = 2, 4 and 8, the recipes' global clipping (1.0).

    python benchmarks/schedules.py [--rounds 3]
    python benchmarks/schedules.py --pictures docs    # one more traced run of each at m = 4: its timeline's picture
    python benchmarks/schedules.py --pictures docs --stages 4   # the same at d = 4, m = 8 (4 processes on the cores)

The model and the run are ``simulator_check.py``'s (a GPT of 6 x 256, seq 128, global batch 16, one thread per
process, traced by ``PipelineTrace``); the configurations are alternated over ``--rounds`` rounds and each one's
median step over its rounds is reported: samples/s, each schedule's rate over 1F1B's at the same m, the idle share
of the step measured from the trace (1 - the stage's compute spans, F, B, W and the optimizer's step, over the traced
steps; the mean of the two stages) and the simulator's idle share and step for the same costs (``planner/simulate.py``
run over the engine's own actions with the costs taken from the run: ``simulator_check.costs_from``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from simulator_check import FIRST, GLOBAL_BATCH, ROOT, TRACED, costs_from, worker  # noqa: E402

MODES, MICROBATCHES = ("flush", "zb_h1", "interleaved", "2bw"), (2, 4, 8)
NAMES = {"flush": "1F1B (flush)", "zb_h1": "ZB-H1", "interleaved": "interleaved 1F1B (2 chunks)", "2bw": "2BW"}
COMPUTE = ("F", "B", "W", "STEP")


def measured_idle(trace: dict) -> float:
    """The traced steps' idle share, the mean over the stages: 1 - compute spans / the traced window."""
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    shares = []
    for stage in sorted({e["pid"] for e in spans}):
        mine = [e for e in spans if e["pid"] == stage]
        window = max(e["ts"] + e["dur"] for e in mine) - min(e["ts"] for e in mine)
        busy = sum(e["dur"] for e in mine if e["cat"] in COMPUTE)
        shares.append(1 - busy / window)
    return statistics.mean(shares)


def run_one(out: Path, mode: str, m: int, picture: bool = False, stages: int = 2) -> tuple[float, float, float, float]:
    """(measured median step s, measured idle share, simulated step s, simulated idle share)."""
    from lightning_pd2bw.engine.layout import Layout
    from lightning_pd2bw.planner.simulate import simulate

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={stages}", __file__]
    result = subprocess.run(
        [*command, "--worker", str(out), mode, str(m), "1", str(int(picture)), str(stages)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if result.returncode:
        raise SystemExit(result.stderr[-4000:])
    trace = json.loads((out / "trace.json").read_text())
    step = statistics.median(json.loads((out / "steps-0.json").read_text()))
    if stages != 2:  # pictures only: the costs model d = 2's stages
        return step, measured_idle(trace), float("nan"), float("nan")
    timing = simulate(Layout(2, m, mode), costs_from(trace, mode, m, True), lambda stage, collective: 0.0)
    simulated_idle = statistics.mean(1 - busy / timing.step_time for busy in timing.busy)
    return step, measured_idle(trace), timing.step_time, simulated_idle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pictures", type=Path, help="write each schedule's recorded timeline here (m = 2d), no table")
    parser.add_argument("--stages", type=int, default=2, help="with --pictures: d (2 or 4)")
    args = parser.parse_args()
    if args.pictures:
        import shutil

        d, m = args.stages, 2 * args.stages
        with tempfile.TemporaryDirectory() as tmp:
            for mode in MODES:
                _, idle, _, _ = run_one(Path(tmp) / mode, mode, m, picture=True, stages=d)
                target = args.pictures / f"schedules_{mode}_d{d}_m{m}.png"
                shutil.copy(Path(tmp) / mode / "timeline.png", target)
                print(f"wrote {target}: idle {idle:.0%} of the traced steps (mean over the stages)")
        return
    results: dict[tuple[str, int], list[tuple[float, float, float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for m in MICROBATCHES:
                order = MODES if round_ % 2 == 0 else tuple(reversed(MODES))  # alternated
                for mode in order:
                    out = Path(tmp) / f"{round_}-{mode}-{m}"
                    results.setdefault((mode, m), []).append(run_one(out, mode, m))
                    step, idle, simulated, _ = results[(mode, m)][-1]
                    print(f"round {round_} {mode:>5} m={m}: {step * 1e3:.1f} ms (simulated {simulated * 1e3:.1f})",
                          flush=True)  # fmt: skip
    print(f"\nmedians of {args.rounds} alternated rounds (steps {FIRST + 1}..{FIRST + TRACED} of each run), d = 2, "
          f"global batch {GLOBAL_BATCH}, clipping 1.0:")  # fmt: skip
    print(
        "| m | schedule | samples/s | over 1F1B | idle share measured | idle share simulated | simulated step error |"
    )
    print("|---|---|---|---|---|---|---|")
    worst = 0.0
    for m in MICROBATCHES:
        base = statistics.median(r[0] for r in results[("flush", m)])
        for mode in MODES:
            rows = results[(mode, m)]
            step, idle = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
            simulated, simulated_idle = statistics.median(r[2] for r in rows), statistics.median(r[3] for r in rows)
            error = simulated / step - 1
            worst = max(worst, abs(error))
            name = NAMES[mode]
            print(f"| {m} | {name} | {GLOBAL_BATCH / step:.1f} | {base / step:.3f}x | {idle:.1%} | "
                  f"{simulated_idle:.1%} | {error:+.1%} |")  # fmt: skip
    print(f"largest simulated step error {worst:.1%} (target 10%)")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(
            Path(sys.argv[2]),
            sys.argv[3],
            int(sys.argv[4]),
            bool(int(sys.argv[5])),
            sys.argv[6] == "1",
            int(sys.argv[7]),
        )
    else:
        main()
