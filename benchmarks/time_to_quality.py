"""Time to quality from ``delayed_rule.py``'s runs: the steps 2BW needs to reach the synchronous rule's (Flush's)
final validation loss, the time to it at 2BW/Flush rate ratios, and the record the docs, the README and
``pd2bw-plan`` read (``--record``: ``docs/_generated/``, ``lightning_pd2bw/planner/step_overhead.json``)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def flush_steps(steps: float, ratio: float, sync_steps: int = 0) -> float:
    """The time of ``steps`` of 2BW in Flush's steps at rate ratio ``ratio``: a synchronous start's first
    ``sync_steps`` drain after each update, so they run at about Flush's rate; the rest at 2BW's."""
    fresh = min(steps, sync_steps)
    return fresh + (steps - fresh) / ratio


def time_to_quality(
    results: dict, args: argparse.Namespace, lengths: list[int], ratios: dict[str, float]
) -> tuple[str, list[float | None]]:
    """Per seed: the 2BW run length whose final validation loss (whole split) equals the sync rule's at ``--steps``,
    interpolated between the horizons around it (``convergence.horizon_to``), as a multiple of sync's steps; and
    2BW's time to it over sync's at each throughput ratio (time ratio = steps ratio / rate ratio; a synchronous
    start's steps at Flush's rate, ``flush_steps``). Returns the table and the steps ratio per seed (None: not
    reached by the longest horizon)."""
    from benchmarks.convergence import horizon_to

    header = " | ".join(f"time at {r:.2f}x ({label})" for label, r in ratios.items())
    lines = [
        f"| seed | sync's loss at {args.steps} | 2BW's at " + ", ".join(map(str, lengths)) + " | 2BW's steps to it "
        f"(x sync's) | {header} |",
        "|---" * (4 + len(ratios)) + "|",
    ]
    overheads, bounds = [], []
    for seed in range(args.seeds):
        target = results[f"sync@{args.steps}/seed{seed}"]["curve"][-1][1]
        horizons = [(n, results[f"2bw@{n}/seed{seed}"]["curve"][-1][1], 0.0) for n in lengths]
        finals = ", ".join(f"{loss:.4f}" for _, loss, _ in horizons)
        found = horizon_to(target, horizons)
        if found is None:
            lines.append(f"| {seed} | {target:.4f} | {finals} | > {lengths[-1] / args.steps:.2f}x (not reached) |")
            overheads.append(None)
            continue
        bound = "" if found[2] else "<= "
        overhead = found[0] / args.steps
        overheads.append(overhead)
        bounds.append(bound)
        times = " | ".join(
            f"{bound}{flush_steps(found[0], r, args.sync_steps) / args.steps:.3f}" for r in ratios.values()
        )
        lines.append(f"| {seed} | {target:.4f} | {finals} | {bound}{overhead:.3f}x | {times} |")
    reached = [o for o in overheads if o is not None]
    if len(reached) == len(overheads):
        mean, bound = statistics.mean(reached), "<= " if any(b for b in bounds) else ""
        times = " | ".join(
            f"{bound}{flush_steps(mean * args.steps, r, args.sync_steps) / args.steps:.3f}" for r in ratios.values()
        )
        lines.append(f"| mean | | | {bound}{mean:.3f}x | {times} |")
    return "\n".join(lines), overheads


def parameter_count(cfg) -> int:
    """The model's parameters, built on the meta device (nothing allocated)."""
    from hydra.utils import instantiate

    model = instantiate(cfg.model)
    with torch.device("meta"):
        model.configure_model()
    return sum(p.numel() for p in model.parameters())


def record(
    args: argparse.Namespace,
    results: dict,
    lengths: list[int],
    table: str,
    overheads: list[float | None],
    ratios: dict[str, float],
) -> None:
    """The one source of the time-to-quality figures: ``docs/_generated/time-to-quality-MODEL-OPTIMIZER.md`` (the
    table with its date, command and corpus; the docs include it), its plot, and the steps ratios ``pd2bw-plan`` prints
    (``lightning_pd2bw/planner/step_overhead.json``)."""
    import datetime

    from benchmarks.corpora import CORPORA, corpus_digest
    from benchmarks.delayed_rule import compose
    from lightning_pd2bw.planner.step_overhead import record as record_overhead
    from lightning_pd2bw.planner.step_overhead import summary_table, with_summary

    cfg, cfg_sync = compose(args, 0, rule="2bw"), compose(args, 0, rule="sync")
    start = f"-sync{args.sync_steps}" if args.sync_steps else ""
    lever_name = getattr(args, "lever", "")  # a lever the overrides try, named in the record
    lever = "-" + "".join(c if c.isalnum() or c == "." else "-" for c in lever_name) if lever_name else ""
    optimizer, name = str(cfg.model.optimizer), f"{args.model}-{cfg.model.optimizer}{start}{lever}"
    size = parameter_count(cfg)
    today = datetime.date.today().isoformat()
    command = "python benchmarks/delayed_rule.py " + " ".join(sys.argv[1:])
    corpus = (
        args.corpus if args.corpus == "stdlib" else f"{args.corpus}, {corpus_digest(CORPORA[args.corpus](args.out))}"
    )
    picture = f"time-to-quality-{name}.png"
    plot(results, args, lengths, ratios, ROOT / "docs" / picture)
    folder = ROOT / "docs" / "_generated"  # included by the pages (pymdownx.snippets), not a page itself
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"time-to-quality-{name}.md").write_text(
        f"{args.model}, {optimizer}, {args.seeds} seed(s), {today} ({corpus}; [the machine](benchmarks.md#machines)):"
        f"\n\n```\n{command}\n```\n\n{table}\n\n![validation loss against time, {name}]({picture})\n"
    )
    record_overhead(
        f"{args.model} ({size / 1e6:.1f}M, {optimizer}{f', sync start {args.sync_steps}' if args.sync_steps else ''}"
        f"{f', {lever_name}' if lever_name else ''})",
        {
            "overheads": [round(o, 4) if o is not None else None for o in overheads],
            "shortest": lengths[0] / args.steps,
            "longest": lengths[-1] / args.steps,
            "optimizer": optimizer,
            "date": today,
            "command": command,
            "ratios": {label: round(ratio, 4) for label, ratio in ratios.items()},
            "sync_steps": args.sync_steps,
            "steps": args.steps,
            "peak_lr": {"flush": float(cfg_sync.model.lr), "2bw": float(cfg.model.lr)},
        },
    )
    readme = ROOT / "README.md"
    readme.write_text(with_summary(readme.read_text()))
    (folder / "time-to-quality-summary.md").write_text(summary_table() + "\n")  # docs/quality.md's lead


def plot(results: dict, args: argparse.Namespace, lengths: list[int], ratios: dict[str, float], path: Path) -> None:
    """The one picture a user decides by: the final validation loss (whole held-out split, mean over seeds) of runs
    of each length against their training time in Flush's steps, 2BW's step taking 1/ratio of Flush's at each rate
    ratio; Flush's final loss (the target) drawn across. Each point is a run that stops there, schedules and all."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def final(key: str) -> float:
        return statistics.mean(results[f"{key}/seed{seed}"]["curve"][-1][1] for seed in range(args.seeds))

    fig, ax = plt.subplots(figsize=(7, 4))
    target = final(f"sync@{args.steps}")
    ax.plot([args.steps], [target], "ko", label=f"Flush, {args.steps} steps")
    ax.axhline(target, color="k", lw=0.6, ls=":")
    losses = [final(f"2bw@{n}") for n in lengths]
    for i, (label, ratio) in enumerate(ratios.items()):
        times = [flush_steps(n, ratio, args.sync_steps) for n in lengths]
        ax.plot(times, losses, f"C{i}o-", label=f"2BW at {ratio:.2f}x Flush's rate ({label})")
    ax.set_xlabel("training time, in Flush's steps (each point a run of that length)")
    ax.set_ylabel("final validation loss (whole held-out split)")
    ax.legend(fontsize=7)
    ax.set_title(f"{args.model}: 2BW's runs of {', '.join(map(str, lengths))} steps against Flush's", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def replan() -> None:
    """The planner's 2BW/Flush rate ratios are its own output, not a measurement: every recorded row's ratios and the
    README's and quality page's lead table re-derived from today's planner (the measured step overheads unchanged)."""
    from lightning_pd2bw.planner.step_overhead import measured, record, summary_table, with_summary

    cache = ROOT / "outputs" / "delayed_rule" / "planned_rates.json"
    cache.unlink(missing_ok=True)
    ratios = {label: round(plan["ratio"], 4) for label, plan in rates_planned().items()}
    for model, entry in measured().items():
        record(model, entry | {"ratios": ratios})
    readme = ROOT / "README.md"
    readme.write_text(with_summary(readme.read_text()))
    (ROOT / "docs" / "_generated" / "time-to-quality-summary.md").write_text(summary_table() + "\n")
    print("planned 2BW/Flush:", ", ".join(f"{label} {ratio:.3f}x" for label, ratio in ratios.items()))


def rates_planned() -> dict:
    """The planner's 2BW/Flush rates, cached beside the runs (``benchmarks/mode_rates.py``)."""
    from benchmarks.mode_rates import planned

    path = ROOT / "outputs" / "delayed_rule" / "planned_rates.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(planned(), indent=1))
    return json.loads(path.read_text())
