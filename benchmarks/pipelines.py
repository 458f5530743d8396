"""Pipeline benchmark: pd2bw 2BW and Flush against one process, DDP and torch.distributed.pipelining.

    python benchmarks/pipelines.py                   # 2 CPU processes x 1 thread, m = 2, 4, 8 (~8 min here)
    python benchmarks/pipelines.py --m 4 --procs 2   # one microbatch count
    python benchmarks/pipelines.py --m 4 --procs 4 --kinds flush,2bw   # depth 4; only some runs
    python benchmarks/pipelines.py --accelerator gpu --procs 2   # GPUs: one process per GPU, NCCL

The same GPT (8 x 384, seq 128, byte vocabulary, tied embedding), the same global batch (m
microbatches of 4 sequences) and the same processes under: one process; Lightning DDP; torch's
ScheduleGPipe and Schedule1F1B (depth = processes); pd2bw flush and 2bw (depth = processes). Each
run is ``benchmarks/pipelines_run.py`` (torchrun for the multi-process ones); samples/s are from the
steady-state steps of one run and are shown as ratios to the single process measured in the same
invocation. Prints one table per microbatch count: samples/s as ratios to one process, to DDP and to the
run's own limit (d x one process's samples/s at the same threads per process; x m/(m+d-1) for the
schedules that flush every batch), the bubble fraction from the timeline, weights and peak stashed
activations per stage; then the targets with their measured values, and writes the Gantt charts of 2BW
and Flush (m = 4) to ``docs/``. The timeline's recording cost is measured by an untraced 2BW run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLUSHING = ("gpipe", "1f1b", "flush")  # schedules that drain every batch: bubble m/(m+d-1)
KINDS = ["single", "ddp", "gpipe", "1f1b", "flush", "2bw", "2bw+ef"]  # 2bw+ef: with the delay correction
MiB = 2**20


def _environment(accelerator: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, BENCH_ACCELERATOR=accelerator)
    env["MALLOC_MMAP_THRESHOLD_"] = "131072"  # freed tensors leave the process: memory figures stay honest
    env.pop("BENCH_TRACE_DIR", None)
    return env


def run(kind: str, m: int, procs: int, out: Path, accelerator: str, trace: bool = True, picture: Path | None = None):
    env = _environment(accelerator)
    if picture is not None:
        env["BENCH_TRACE_DIR"] = str(picture)
    config = json.dumps({"kind": kind, "m": m, "trace": trace})
    script = str(ROOT / "benchmarks" / "pipelines_run.py")
    if kind == "single":
        command = [sys.executable, script, config, str(out)]
    else:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"]
        command = [*launcher, script, config, str(out)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200)
    if result.returncode:
        raise SystemExit(f"{kind} m={m} failed:\n{result.stderr[-4000:]}")
    return _records(out)


def _records(out: Path) -> dict:
    ranks = sorted(out.glob("rank-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    records = [json.loads(p.read_text()) for p in ranks]
    return {
        "samples_per_sec": min(r["samples_per_sec"] for r in records),  # the slowest rank sets the pace
        "stages": sorted(records, key=lambda r: r["stage"]),
    }


def side_by_side(m: int, procs: int, out: Path) -> float:
    """The machine's own ceiling for ``procs`` processes: that many single-process runs at once, no communication;
    their summed samples/s (on shared cores or memory bandwidth it falls short of procs x one process alone)."""
    env = _environment("cpu")
    config = json.dumps({"kind": "single", "m": m, "trace": False})
    script = str(ROOT / "benchmarks" / "pipelines_run.py")
    jobs = [
        subprocess.Popen([sys.executable, script, config, str(out / f"copy-{i}")], env=env, stderr=subprocess.PIPE)
        for i in range(procs)
    ]
    for job in jobs:
        _, err = job.communicate(timeout=1200)
        if job.returncode:
            raise SystemExit(f"side-by-side single runs failed:\n{err.decode()[-4000:]}")
    return sum(_records(out / f"copy-{i}")["samples_per_sec"] for i in range(procs))


def per_stage(result: dict, key: str, scale: float = 1.0, fmt: str = "{:.0f}") -> str:
    values = [r.get(key) for r in result["stages"]]
    if any(v is None for v in values):
        return "-"
    return " / ".join(fmt.format(v * scale) for v in values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", type=int, nargs="+", default=[2, 4, 8], help="microbatch counts")
    parser.add_argument("--procs", type=int, default=2, help="processes (= pipeline depth, = DDP width)")
    parser.add_argument("--kinds", default=",".join(KINDS), help="runs to make (single and ddp always)")
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--docs", type=Path, default=ROOT / "docs", help="where the Gantt charts go")
    args = parser.parse_args()
    d = args.procs
    kinds = [k for k in KINDS if k in {"single", "ddp", *args.kinds.split(",")}]
    results: dict[tuple[str, int], dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for m in args.m:
            for kind in kinds:
                picture = Path(tmp) / f"picture-{kind}-{m}" if kind in ("2bw", "flush") and m == 4 else None
                results[kind, m] = run(kind, m, d, Path(tmp) / f"{kind}-{m}", args.accelerator, picture=picture)
                print(f"  {kind:>6} m={m}: {results[kind, m]['samples_per_sec']:.2f} samples/s", file=sys.stderr)
                if picture is not None:
                    args.docs.mkdir(parents=True, exist_ok=True)
                    shutil.copy(picture / "timeline.png", args.docs / f"timeline_{kind}_d{d}_m{m}.png")
        overhead_m = 4 if 4 in args.m else args.m[0]
        untraced = run("2bw", overhead_m, d, Path(tmp) / "2bw-untraced", args.accelerator, trace=False)
        ceiling = side_by_side(overhead_m, d, Path(tmp) / "side-by-side") if args.accelerator == "cpu" else None

    print(f"\nGPT 8x384, seq 128, microbatch 4 sequences, {d} processes x 1 thread ({args.accelerator}); depth {d}")
    print(
        "limit: d x one process's samples/s (same threads per process); for the flushing schedules (flush, gpipe,\n"
        "1f1b) also x m/(m+d-1), their bubble-free ideal. 'x limit' is each run's samples/s over its own limit."
    )
    header = (
        f"{'m':>2} {'run':>7} | {'samples/s':>9} {'x single':>8} {'x ddp':>6} {'x limit':>7} | "
        f"{'bubble per stage':>17} | {'weights MiB per stage':>21} | {'stashed activations MiB per stage':>33}"
    )
    for m in args.m:
        single = results["single", m]["samples_per_sec"]
        ddp = results["ddp", m]["samples_per_sec"]
        print(f"\nglobal batch {4 * m} sequences (m = {m})")
        print(header)
        for kind in kinds:
            r = results[kind, m]
            speed = r["samples_per_sec"]
            limit = single * (1 if kind == "single" else d) * (m / (m + d - 1) if kind in FLUSHING else 1.0)
            print(
                f"{m:>2} {kind:>7} | {speed:>9.2f} {speed / single:>8.2f} {speed / ddp:>6.2f} {speed / limit:>7.2f} | "
                f"{per_stage(r, 'bubble', 100, '{:.1f}%'):>17} | {per_stage(r, 'weight_bytes', 1 / MiB):>21} | "
                f"{per_stage(r, 'activation_bytes', 1 / MiB):>33}"
            )

    print("\ntargets, measured in this invocation (issue 20's at d=2, m=4: 2bw >= 1.9x single, >= 1.0x ddp):")
    for m in args.m:
        if not {"flush", "2bw", "2bw+ef", "gpipe"} <= set(kinds):
            continue
        speed = {kind: results[kind, m]["samples_per_sec"] for kind in kinds}
        ideal = m / (m + d - 1)
        efficiency = speed["flush"] / (d * speed["single"])
        bubble = max(r["bubble"] for r in results["2bw", m]["stages"])
        stash = max(r["activation_bytes"] for r in results["2bw", m]["stages"])
        gpipe = max(r["activation_bytes"] for r in results["gpipe", m]["stages"])
        print(
            f"  m={m}: 2bw/single {speed['2bw'] / speed['single']:.2f} (limit {d}) | 2bw/ddp "
            f"{speed['2bw'] / speed['ddp']:.2f} | 2bw/flush {speed['2bw'] / speed['flush']:.2f} | flush efficiency "
            f"{efficiency:.3f} vs ideal m/(m+d-1) {ideal:.3f} ({efficiency / ideal - 1:+.1%}) | "
            f"2bw bubble {bubble:.1%} | 2bw/gpipe stashed activations {stash / gpipe:.2f} vs d/m {d / m:.2f} | "
            f"2bw+ef/flush {speed['2bw+ef'] / speed['flush']:.2f}, 2bw+ef/2bw {speed['2bw+ef'] / speed['2bw']:.3f}"
        )
    if ceiling is not None:
        single = results["single", overhead_m]["samples_per_sec"]
        print(
            f"  the machine's ceiling (m={overhead_m}): {d} single-process runs side by side, no communication, "
            f"{ceiling:.2f} samples/s = {ceiling / single:.2f}x one process alone (limit {d}); 2bw reaches "
            f"{results['2bw', overhead_m]['samples_per_sec'] / ceiling:.2f} of it, ddp "
            f"{results['ddp', overhead_m]['samples_per_sec'] / ceiling:.2f}"
        )
    traced = results["2bw", overhead_m]["samples_per_sec"]
    print(
        f"  timeline recording overhead (2bw, m={overhead_m}): {traced:.2f} samples/s traced vs "
        f"{untraced['samples_per_sec']:.2f} untraced ({traced / untraced['samples_per_sec'] - 1:+.1%})"
    )


if __name__ == "__main__":
    main()
