"""Pipeline benchmark: pd2bw 2BW and Flush against one process, DDP and torch.distributed.pipelining.

    python benchmarks/pipelines.py                   # 2 CPU processes x 1 thread, m = 2, 4, 8 (~8 min here)
    python benchmarks/pipelines.py --m 4 --procs 2   # one microbatch count
    python benchmarks/pipelines.py --m 4 --procs 4 --kinds flush,2bw   # depth 4; only some runs
    python benchmarks/pipelines.py --m 4 --kinds flush,2bw --repeat 3 --readme   # medians; rewrites docs/benchmarks-log.md's block
    python benchmarks/pipelines.py --accelerator gpu --procs 2   # GPUs: one process per GPU, NCCL

The same GPT (8 x 384, seq 128, byte vocabulary, tied embedding), the same global batch (m
microbatches of 4 sequences) and the same processes under: one process; Lightning DDP; torch's
ScheduleGPipe and Schedule1F1B (depth = processes); pd2bw flush and 2bw (depth = processes). Each
run is ``benchmarks/pipelines_run.py`` (torchrun for the multi-process ones); samples/s are from the
steady-state steps of one run and are shown as ratios to the single process measured in the same
invocation (run first and again last; the mean of the two, so that the machine's drift during an
invocation does not favour the runs made near the reference). Prints one table per microbatch count:
samples/s as ratios to one process, to DDP and to the run's own limit (d x one process's samples/s at
the same threads per process; x m/(m+d-1) for the schedules that flush every batch), the bubble fraction from the timeline, weights and peak stashed
activations per stage; then each invocation's ratios, the machine's own ceiling (d single-process runs side by
side, no communication: what d busy processes get from these cores) and the targets, and writes the Gantt charts
of 2BW and Flush (m = 4) to ``docs/``. The timeline's recording cost is measured by an untraced 2BW run.
``--repeat N`` makes N invocations (every run once in each, so ratios are taken side by side) and shows medians;
``--readme`` writes the report into docs/benchmarks-log.md between ``<!-- pipelines.py d=N cpu -->`` and
``<!-- /pipelines.py -->``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLUSHING = ("gpipe", "1f1b", "flush", "flush+compile")  # schedules that drain every batch: bubble m/(m+d-1)
KINDS = ["single", "ddp", "gpipe", "1f1b", "flush", "2bw", "2bw+ef", "2bw+la", "2bw+compile", "flush+compile"]
# 2bw+ef: with the delay correction; 2bw+la: lookahead=1 (one more forward in flight before the last stage);
# +compile: compile=True (torch.compile per layer, inductor)
PD2BW = ("flush", "2bw", "2bw+ef", "2bw+la", "2bw+compile", "flush+compile")  # ours: traced, so their bubble is known
MiB = 2**20


def _environment(accelerator: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, BENCH_ACCELERATOR=accelerator)
    # glibc's own allocator settings, as users run: a fixed MALLOC_MMAP_THRESHOLD_ (set here until 2026-11-22) makes
    # every large tensor a fresh mmap (page faults on each allocation); it slowed the single process (whole-batch
    # tensors) ~20% and 2BW ~5% on this machine, flattering every ratio. The memory figures do not read the RSS.
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
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


def median(values: list[float]) -> float:
    return statistics.median(values)


def measure(args: argparse.Namespace, kinds: list[str], tmp: Path, invocation: int) -> dict:
    """One invocation: every run once, side by side in time; ratios are taken within it."""
    d, results = args.procs, {}
    for m in args.m:
        for kind in kinds:
            first = invocation == 0 and kind in ("2bw", "flush") and m == 4
            picture = tmp / f"picture-{kind}-{m}" if first else None
            out = tmp / f"{invocation}-{kind}-{m}"
            results[kind, m] = run(kind, m, d, out, args.accelerator, picture=picture)
            print(f"  [{invocation + 1}] {kind:>6} m={m}: {results[kind, m]['samples_per_sec']:.2f}", file=sys.stderr)
            if picture is not None:
                args.docs.mkdir(parents=True, exist_ok=True)
                shutil.copy(picture / "timeline.png", args.docs / f"timeline_{kind}_d{d}_m{m}.png")
    m = 4 if 4 in args.m else args.m[0]
    results["untraced"] = run("2bw", m, d, tmp / f"{invocation}-2bw-untraced", args.accelerator, trace=False)
    if args.accelerator == "cpu":
        results["ceiling"] = side_by_side(m, d, tmp / f"{invocation}-side-by-side")
    for m in args.m:  # one process again, last: the reference is the mean of the runs that bracket the others
        again = run("single", m, d, tmp / f"{invocation}-single-again-{m}", args.accelerator)["samples_per_sec"]
        bracket(results["single", m], again)
        print(f"  [{invocation + 1}] single m={m} again: {again:.2f}", file=sys.stderr)
    return results


def bracket(single: dict, again: float) -> None:
    """The single process's record: its samples/s become the mean of its first run and ``again`` (the last)."""
    single["bracket"] = [single["samples_per_sec"], again]
    single["samples_per_sec"] = statistics.mean(single["bracket"])


def limit_of(kind: str, m: int, d: int, single: float) -> float:
    """d x one process (1 for the single process itself); x m/(m+d-1) for the schedules that flush every batch."""
    return single * (1 if kind == "single" else d) * (m / (m + d - 1) if kind in FLUSHING else 1.0)


def report(args: argparse.Namespace, kinds: list[str], runs: list[dict]) -> str:
    d, lines = args.procs, []
    speed = lambda r, kind, m: r[kind, m]["samples_per_sec"]  # noqa: E731
    lines.append(
        f"GPT 8x384, seq 128, microbatch 4 sequences, {d} processes x 1 thread ({args.accelerator}); depth {d}; "
        f"{len(runs)} invocation(s): samples/s and ratios are medians over them, each ratio taken within one invocation"
    )
    lines.append(
        "limit: d x one process's samples/s (same threads per process); for the flushing schedules (flush, gpipe,\n"
        "1f1b) also x m/(m+d-1), their bubble-free ideal. 'x limit' is each run's samples/s over its own limit."
    )
    header = (
        f"{'m':>2} {'run':>7} | {'samples/s':>9} {'x single':>8} {'x ddp':>6} {'x limit':>7} | "
        f"{'bubble per stage':>17} | {'weights MiB per stage':>21} | {'stashed activations MiB per stage':>33}"
    )
    for m in args.m:
        lines += ["", f"global batch {4 * m} sequences (m = {m})", header]
        for kind in kinds:
            samples = median([speed(r, kind, m) for r in runs])
            x_single = median([speed(r, kind, m) / speed(r, "single", m) for r in runs])
            x_ddp = median([speed(r, kind, m) / speed(r, "ddp", m) for r in runs])
            x_limit = median([speed(r, kind, m) / limit_of(kind, m, d, speed(r, "single", m)) for r in runs])
            first = runs[0][kind, m]
            lines.append(
                f"{m:>2} {kind:>7} | {samples:>9.2f} {x_single:>8.2f} {x_ddp:>6.2f} {x_limit:>7.2f} | "
                f"{per_stage(first, 'bubble', 100, '{:.1f}%'):>17} | {per_stage(first, 'weight_bytes', 1 / MiB):>21} | "
                f"{per_stage(first, 'activation_bytes', 1 / MiB):>33}"
            )
    m = 4 if 4 in args.m else args.m[0]
    each = lambda f: ", ".join(f"{f(r):.2f}" for r in runs)  # noqa: E731
    lines += ["", f"per invocation (m = {m}):"]
    for kind in [k for k in kinds if k != "single"]:
        lines.append(
            f"  {kind:>6} x single: {each(lambda r, k=kind: speed(r, k, m) / speed(r, 'single', m))}   x ddp: "
            f"{each(lambda r, k=kind: speed(r, k, m) / speed(r, 'ddp', m))}   bubble % (worst stage): "
            f"{each(lambda r, k=kind: 100 * max(x['bubble'] for x in r[k, m]['stages'])) if kind in PD2BW else '-'}"
        )
    if "bracket" in runs[0]["single", m]:
        lines.append(
            "  one process, first and last run of each invocation (the reference: their mean): "
            + ", ".join("{:.2f} / {:.2f}".format(*r["single", m]["bracket"]) for r in runs)
        )
    if "ceiling" in runs[0]:
        ceiling = [r["ceiling"] / speed(r, "single", m) for r in runs]
        lines.append(
            f"  the machine's ceiling: {d} single-process runs side by side (no communication) reach "
            f"{each(lambda r: r['ceiling'] / speed(r, 'single', m))} x one process alone (median {median(ceiling):.2f}; "
            f"limit {d}); over it, "
            + ", ".join(
                f"{k} {each(lambda r, k=k: speed(r, k, m) / r['ceiling'])}" for k in kinds if k in ("ddp", *PD2BW)
            )
        )
    if "2bw" in kinds:
        lines.append(
            f"  timeline recording (2bw traced / untraced): "
            f"{each(lambda r: speed(r, '2bw', m) / r['untraced']['samples_per_sec'])}"
        )
    for kind in [k for k in ("2bw", "2bw+la") if k in kinds and d == 2 and m == 4]:
        x_single = median([speed(r, kind, m) / speed(r, "single", m) for r in runs])
        x_ddp = median([speed(r, kind, m) / speed(r, "ddp", m) for r in runs])
        lines.append(
            f"targets at d=2, m=4 (medians): {kind} x single {x_single:.2f} (>= 1.9: "
            f"{'met' if x_single >= 1.9 else 'missed'}), {kind} x ddp {x_ddp:.2f} (>= 1.0: "
            f"{'met' if x_ddp >= 1.0 else 'missed'})"
        )
    return "\n".join(lines)


def write_readme(text: str, command: str, procs: int, accelerator: str) -> None:
    """Replace the block between ``<!-- pipelines.py d=N ACC -->`` and ``<!-- /pipelines.py -->`` of the benchmarks
    page's results log (``docs/benchmarks-log.md``)."""
    readme = ROOT / "docs" / "benchmarks-log.md"
    content = readme.read_text()
    begin, end = f"<!-- pipelines.py d={procs} {accelerator} -->", "<!-- /pipelines.py -->"
    if begin not in content:
        raise SystemExit(f"docs/benchmarks-log.md has no block {begin} ... {end} to regenerate")
    head, rest = content.split(begin, 1)
    _, tail = rest.split(end, 1)
    block = f"{begin}\n`{command}` ({date.today()}):\n\n```\n{text}\n```\n{end}"
    readme.write_text(head + block + tail)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--m", type=int, nargs="+", default=[2, 4, 8], help="microbatch counts")
    parser.add_argument("--procs", type=int, default=2, help="processes (= pipeline depth, = DDP width)")
    parser.add_argument("--kinds", default=",".join(KINDS), help="runs to make (single and ddp always)")
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "gpu"])
    parser.add_argument("--repeat", type=int, default=1, help="invocations; the tables show their medians")
    parser.add_argument(
        "--readme", action="store_true", help="write the report into docs/benchmarks-log.md's block for it"
    )
    parser.add_argument("--docs", type=Path, default=ROOT / "docs", help="where the Gantt charts go")
    args = parser.parse_args()
    kinds = [k for k in KINDS if k in {"single", "ddp", *args.kinds.split(",")}]
    with tempfile.TemporaryDirectory() as tmp:
        runs = [measure(args, kinds, Path(tmp), i) for i in range(args.repeat)]
    text = report(args, kinds, runs)
    print("\n" + text)
    if args.readme:
        options = " ".join(a for a in sys.argv[1:] if a != "--readme")
        write_readme(text, f"python benchmarks/pipelines.py {options}".strip(), args.procs, args.accelerator)


if __name__ == "__main__":
    main()
