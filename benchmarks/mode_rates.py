"""2BW's rate over Flush's, the ratio that turns steps to a loss into time to it: measured here and planned.

    python benchmarks/mode_rates.py                              # both sources for GPT small, printed
    python benchmarks/mode_rates.py --model gpt_tiny --repeats 5

- **measured**: ``pd2bw-train`` as a user starts it, both modes on the same 2 CPU processes, alternated
  (Flush, 2BW, Flush, ...) ``--repeats`` times in one invocation (this machine drifts by 10-20% within minutes, so each
  ratio is of neighbouring runs); each run's rate is its steps after the first log over their training seconds
  (from the run's own ``tokens_per_sec`` logs: start-up and the first steps left out), the ratio the median.
- **planned**: ``pd2bw-plan`` for the gpt13b recipe on 8 x 8 H100 and for the paper's GPT-2.2B on 64 V100
  (`docs/planner-accuracy.md`), each mode's best plan (2BW against the fastest synchronous schedule, Flush, ZB-H1 or
  interleaved 1F1B, which is planned but not run by the engine): simulated, never run.

Used by ``benchmarks/delayed_rule.py --horizons`` (time to quality); results cached in ``OUT/mode_rates.json``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: benchmarks.* importable

PLANNED = {  # label -> pd2bw-plan's arguments (both modes get the same ones)
    # each mode at its best: its gradients and placement as the planner weighs them (the recipe fixes them for 2BW)
    "gpt13b, 8 x 8 H100 (planned)": [
        "recipe=gpt13b",
        "cluster=h100_80g_8x8",
        "strategy.shard_gradients=null",
        "strategy.placement=null",
    ],
    "GPT-2.2B, 64 V100 (planned)": [
        "recipe=gpt13b",
        "model.config.n_layer=32",
        "model.config.n_embd=2304",
        "model.config.n_head=32",
        "data.seq_len=512",
        "global_batch_size=512",
        "cluster=v100_16g_8x8",
        "strategy.shard_gradients=null",
        "strategy.placement=null",
    ],
}
BEST = re.compile(r"^best: .*: ([0-9.]+) samples/s predicted", re.M)
INTERLEAVED = re.compile(r"^synchronous plans: .*interleaved 1F1B ([0-9.]+) samples/s", re.M)  # where it fits
START = re.compile(r"its synchronous start ([0-9.]+) samples/s")  # Flush's rule in 2BW's best layout


def planned_rate(arguments: list[str], mode: str) -> tuple[float, float | None, float | None]:
    """The best plan's samples/s as ``pd2bw-plan`` prints it for ``mode``, interleaved 1F1B's (planned at the other
    plans' layouts, where it fits; else None) and 2BW's synchronous start's (None where not printed)."""
    command = [sys.executable, "-m", "lightning_pd2bw.cli.plan", *arguments, f"strategy.mode={mode}"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
    found, interleaved, start = (pattern.search(done.stdout) for pattern in (BEST, INTERLEAVED, START))
    if not found:
        raise RuntimeError(f"{' '.join(command)} printed no 'best:' line:\n{done.stdout[-2000:]}")
    return float(found[1]), float(interleaved[1]) if interleaved else None, float(start[1]) if start else None


def planned() -> dict[str, dict]:
    """Per planned setting: each mode's predicted samples/s, and 2BW's over the fastest synchronous schedule's
    (``against``: Flush or ZB-H1; every synchronous schedule trains by Flush's rule)."""
    from lightning_pd2bw.cli.plan import INTERLEAVED_NAME
    from lightning_pd2bw.planner.step_overhead import SYNCHRONOUS

    rates = {}
    names = SYNCHRONOUS | {"interleaved": INTERLEAVED_NAME}  # interleaved: planned, not run by the engine
    for label, arguments in PLANNED.items():
        both = {mode: planned_rate(arguments, mode) for mode in ("2bw", *SYNCHRONOUS)}
        found = {mode: rate for mode, (rate, _, _) in both.items()}
        if both["2bw"][1] is not None:
            found["interleaved"] = both["2bw"][1]
        fastest = max((mode for mode in names if mode in found), key=found.get)
        start = both["2bw"][2]
        rates[label] = found | {
            "ratio": found["2bw"] / found[fastest],
            "against": names[fastest],
            "slowdown": found[fastest] / start if start else 1.0,  # the start's steps against the best synchronous
            "arguments": arguments,
        }
    return rates


def measured_rate(folder: Path) -> float:
    """Steps per training second after the run's first log (start-up and the first steps left out)."""
    from benchmarks.convergence import seconds

    points = seconds(folder)
    (first_step, first_s), (last_step, last_s) = points[0], points[-1]
    return (last_step - first_step) / (last_s - first_s)


def measured(model: str, corpus: str, steps: int, repeats: int, out: Path) -> dict:
    """2BW's steps/s over Flush's through ``pd2bw-train`` on 2 CPU processes, ``repeats`` alternated pairs."""
    from benchmarks.convergence import train

    ratios, rates = [], {"flush": [], "2bw": []}
    for repeat in range(repeats):
        for mode in ("flush", "2bw"):
            folder = out / f"rate-{model}-{corpus}-{mode}-{repeat}"
            settings = ["trainer.enable_checkpointing=false", "trainer.limit_val_batches=0", f"strategy.mode={mode}"]
            if (folder / "summary.json").exists():
                subprocess.run(["rm", "-r", str(folder)], check=True)  # a rate is measured now, beside its pair
            train(folder, model, corpus, out, steps, 0, settings, val_every=steps, log_every=10)
            rates[mode].append(measured_rate(folder))
        ratios.append(rates["2bw"][-1] / rates["flush"][-1])
    return {
        "ratio": statistics.median(ratios),
        "ratios": ratios,
        "steps_per_s": rates,
        "command": f"python benchmarks/mode_rates.py --model {model} --corpus {corpus} --steps {steps} "
        f"--repeats {repeats}",
    }


def rates(model: str, corpus: str, out: Path, steps: int = 100, repeats: int = 3, refresh: bool = False) -> dict:
    """Both sources, cached in ``out/mode_rates.json`` by model and corpus (``refresh``: measured again)."""
    path = out / "mode_rates.json"
    cache = json.loads(path.read_text()) if path.exists() else {}
    key = f"{model}/{corpus}"
    if refresh or key not in cache:
        cache[key] = {"measured": measured(model, corpus, steps, repeats, out), "planned": planned()}
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cache, indent=1))
    return cache[key]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt_small")
    parser.add_argument("--corpus", default="fortunes")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "delayed_rule")
    args = parser.parse_args()
    found = rates(args.model, args.corpus, args.out, args.steps, args.repeats, refresh=True)
    here = found["measured"]
    print(
        f"measured here, {args.model}: 2BW/Flush {here['ratio']:.3f} (pairs: {', '.join(f'{r:.3f}' for r in here['ratios'])})"
    )
    for label, plan in found["planned"].items():
        print(
            f"{label}: 2BW {plan['2bw']:.1f}, Flush {plan['flush']:.1f}, ZB-H1 {plan['zb_h1']:.1f} samples/s, "
            f"2BW/{plan['against']} {plan['ratio']:.3f}"
        )


if __name__ == "__main__":
    main()
