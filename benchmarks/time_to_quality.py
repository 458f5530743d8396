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


def flush_steps(steps: float, ratio: float, sync_steps: int = 0, slowdown: float = 1.0) -> float:
    """The time of ``steps`` of 2BW in Flush's steps at rate ratio ``ratio``: a synchronous start's first
    ``sync_steps`` drain after each update, Flush's rule in 2BW's layout (``slowdown`` times the best synchronous
    plan's step, as ``pd2bw-plan`` charges them); the rest at 2BW's."""
    fresh = min(steps, sync_steps)
    return fresh * slowdown + (steps - fresh) / ratio


def time_to_quality(
    results: dict, args: argparse.Namespace, lengths: list[int], ratios: dict[str, float]
) -> tuple[str, list[float | None]]:
    """Per seed: the 2BW run length whose final validation loss (whole split) equals the sync rule's at ``--steps``,
    interpolated between the horizons around it (``convergence.horizon_to``), as a multiple of sync's steps; and
    2BW's time to it over sync's at each throughput ratio (time ratio = steps ratio / rate ratio; a synchronous
    start's steps at Flush's rate, ``flush_steps``). Returns the table and the steps ratio per seed (None: not
    reached by the longest horizon)."""
    entry = measurement(results, args, lengths, ratios)
    return table_of(entry), entry["overheads"]


def measurement(results: dict, args: argparse.Namespace, lengths: list[int], ratios: dict[str, float]) -> dict:
    """What a table and a plot are drawn from, as ``step_overhead.json`` keeps it: each seed's final losses (sync's
    at ``--steps``, 2BW's at each length), the steps ratios found from them at full precision, the rate ratios."""
    from benchmarks.convergence import horizon_to

    def final(key: str) -> float | None:  # None: a longer horizon a seed needed no run of (reached before it)
        return results[key]["curve"][-1][1] if key in results else None

    losses = {
        "sync": [final(f"sync@{args.steps}/seed{seed}") for seed in range(args.seeds)],
        "2bw": {str(n): [final(f"2bw@{n}/seed{seed}") for seed in range(args.seeds)] for n in lengths},
    }
    overheads = []
    for seed, target in enumerate(losses["sync"]):
        runs = [(n, losses["2bw"][str(n)][seed], 0.0) for n in lengths if losses["2bw"][str(n)][seed] is not None]
        found = horizon_to(target, runs)
        overheads.append(None if found is None else found[0] / args.steps)
    return {
        "overheads": overheads,
        "losses": losses,
        "shortest": lengths[0] / args.steps,
        "longest": lengths[-1] / args.steps,
        "ratios": dict(ratios),
        "sync_steps": args.sync_steps,
        "steps": args.steps,
    }


def table_of(entry: dict) -> str:
    """The per-seed table of one measurement (``measurement``, or a record of ``step_overhead.json``) at its
    ``ratios``: what ``--record`` writes and ``--replan`` rewrites when the planner's ratios move."""
    from lightning_pd2bw.planner.step_overhead import time_ratio

    ratios, steps, lengths = entry["ratios"], entry["steps"], [int(n) for n in entry["losses"]["2bw"]]
    slow = entry.get("slowdowns", {})  # the start's steps in 2BW's layout (``flush_steps``)
    header = " | ".join(f"time at {r:.2f}x ({label})" for label, r in ratios.items())
    lines = [
        f"| seed | sync's loss at {steps} | 2BW's at " + ", ".join(map(str, lengths)) + " | 2BW's steps to it "
        f"(x sync's) | {header} |",
        "|---" * (4 + len(ratios)) + "|",
    ]
    for seed, (target, overhead) in enumerate(zip(entry["losses"]["sync"], entry["overheads"])):
        finals = ", ".join(_loss(entry["losses"]["2bw"][str(n)][seed]) for n in lengths)
        if overhead is None:
            lines.append(f"| {seed} | {target:.4f} | {finals} | > {entry['longest']:.2f}x (not reached) |")
            continue
        bound = "<= " if overhead <= entry["shortest"] else ""  # reached by the shortest run: an upper bound
        times = " | ".join(f"{bound}{time_ratio(entry, overhead, r, slow.get(k, 1.0)):.3f}" for k, r in ratios.items())
        lines.append(f"| {seed} | {target:.4f} | {finals} | {bound}{overhead:.3f}x | {times} |")
    if None not in entry["overheads"]:
        mean = statistics.mean(entry["overheads"])
        bound = "<= " if any(o <= entry["shortest"] for o in entry["overheads"]) else ""
        times = " | ".join(f"{bound}{time_ratio(entry, mean, r, slow.get(k, 1.0)):.3f}" for k, r in ratios.items())
        lines.append(f"| mean | | | {bound}{mean:.3f}x | {times} |")
    return "\n".join(lines)


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def page_text(entry: dict) -> str:
    """``docs/_generated/PAGE.md`` of one record of ``step_overhead.json``: heading, command, table, plot."""
    page = entry["page"]
    return (
        f"{entry['heading']}\n\n```\n{entry['command']}\n```\n\n{table_of(entry)}\n\n"
        f"![validation loss against time, {page.removeprefix('time-to-quality-')}]({page}.png)\n"
    )


def write_page(entry: dict) -> None:
    """``page_text`` into ``docs/_generated/`` (the docs include it) and its plot into ``docs/PAGE.png``."""
    plot(entry, ROOT / "docs" / f"{entry['page']}.png")
    folder = ROOT / "docs" / "_generated"  # included by the pages (pymdownx.snippets), not a page itself
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{entry['page']}.md").write_text(page_text(entry))


def parameter_count(cfg) -> int:
    """The model's parameters, built on the meta device (nothing allocated)."""
    from hydra.utils import instantiate

    model = instantiate(cfg.model)
    with torch.device("meta"):
        model.configure_model()
    return sum(p.numel() for p in model.parameters())


def record(args: argparse.Namespace, results: dict, lengths: list[int], ratios: dict[str, float]) -> None:
    """The one source of the time-to-quality figures: the record in ``lightning_pd2bw/planner/step_overhead.json``
    (each seed's losses, the steps ratios ``pd2bw-plan`` prints, the date, command and corpus), from which
    ``write_page`` draws ``docs/_generated/time-to-quality-MODEL-OPTIMIZER.md`` (the docs include it) and its plot."""
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
    corpus = (
        args.corpus if args.corpus == "stdlib" else f"{args.corpus}, {corpus_digest(CORPORA[args.corpus](args.out))}"
    )
    entry = measurement(results, args, lengths, ratios) | {
        "optimizer": optimizer,
        "date": today,
        "command": "python benchmarks/delayed_rule.py " + " ".join(sys.argv[1:]),
        "peak_lr": {"flush": float(cfg_sync.model.lr), "2bw": float(cfg.model.lr)},
        "page": f"time-to-quality-{name}",
        "heading": f"{args.model}, {optimizer}, {args.seeds} seed(s), {today} ({corpus}; "
        "[the machine](benchmarks.md#machines)):",
    }
    entry["overheads"] = [round(o, 4) if o is not None else None for o in entry["overheads"]]
    entry["ratios"] = {label: round(ratio, 4) for label, ratio in ratios.items()}
    planned = rates_planned()  # the comparator and the start's rate where the ratio is a planned one
    entry["against"] = {label: planned[label].get("against", "Flush") for label in ratios if label in planned}
    entry["slowdowns"] = {label: round(planned[label].get("slowdown", 1.0), 4) for label in ratios if label in planned}
    entry["losses"] = json.loads(json.dumps(entry["losses"]))
    record_overhead(
        f"{args.model} ({size / 1e6:.1f}M, {optimizer}{f', sync start {args.sync_steps}' if args.sync_steps else ''}"
        f"{f', {lever_name}' if lever_name else ''})",
        entry,
    )
    write_page(entry)
    readme = ROOT / "README.md"
    readme.write_text(with_summary(readme.read_text()))
    (ROOT / "docs" / "_generated" / "time-to-quality-summary.md").write_text(summary_table() + "\n")  # quality.md


def recorded_results(args: argparse.Namespace, lengths: list[int], seeds: int) -> dict:
    """The first ``seeds`` seeds' final losses, in ``train``'s form (``curve``: the final point alone), from the record
    in ``step_overhead.json`` of these settings (model, steps, start, peak rates; its horizons among ``lengths``): runs
    of an earlier session whose files are gone, so a record grows seed by seed. A clear error where none matches."""
    from benchmarks.delayed_rule import compose
    from lightning_pd2bw.planner.step_overhead import measured

    rates = {"flush": float(compose(args, 0, rule="sync").model.lr), "2bw": float(compose(args, 0).model.lr)}
    for label, entry in measured().items():
        same = (
            label.startswith(f"{args.model} (")
            and entry["steps"] == args.steps
            and entry.get("sync_steps", 0) == args.sync_steps
            and entry.get("peak_lr") == rates
            and set(int(n) for n in entry["losses"]["2bw"]) <= set(lengths)
            and len(entry["losses"]["sync"]) >= seeds
        )
        if same:
            nan = float("nan")  # the run's time was not kept
            found = {f"sync@{args.steps}/seed{s}": entry["losses"]["sync"][s] for s in range(seeds)}
            recorded = entry["losses"]["2bw"]
            found |= {
                f"2bw@{n}/seed{s}": recorded[str(n)][s] for n in lengths if str(n) in recorded for s in range(seeds)
            }
            found = {key: loss for key, loss in found.items() if loss is not None}
            return {
                key: {"curve": [[int(key.split("@")[1].split("/")[0]), loss]], "seconds": nan}
                for key, loss in found.items()
            }
    raise SystemExit(
        f"--recorded-seeds {seeds}: no record in step_overhead.json holds {seeds} seeds of {args.model} at --steps "
        f"{args.steps}, --sync-steps {args.sync_steps}, peak rates {rates} and horizons {lengths}"
    )


def plot(entry: dict, path: Path) -> None:
    """The one picture a user decides by: the final validation loss (whole held-out split, mean over seeds) of runs
    of each length against their training time in Flush's steps, 2BW's step taking 1/ratio of Flush's at each rate
    ratio; Flush's final loss (the target) drawn across. Each point is a run that stops there, schedules and all."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, losses = entry["steps"], entry["losses"]
    lengths = [int(n) for n in losses["2bw"] if None not in losses["2bw"][n]]  # the lengths every seed ran
    fig, ax = plt.subplots(figsize=(7, 4))
    target = statistics.mean(losses["sync"])
    ax.plot([steps], [target], "ko", label=f"Flush, {steps} steps")
    ax.axhline(target, color="k", lw=0.6, ls=":")
    finals = [statistics.mean(losses["2bw"][str(n)]) for n in lengths]
    for i, (label, ratio) in enumerate(entry["ratios"].items()):
        slowdown = entry.get("slowdowns", {}).get(label, 1.0)
        times = [flush_steps(n, ratio, entry.get("sync_steps", 0), slowdown) for n in lengths]
        ax.plot(times, finals, f"C{i}o-", label=f"2BW at {ratio:.2f}x Flush's rate ({label})")
    ax.set_xlabel("training time, in Flush's steps (each point a run of that length)")
    ax.set_ylabel("final validation loss (whole held-out split)")
    ax.legend(fontsize=7)
    model = entry["page"].removeprefix("time-to-quality-").split("-")[0]
    ax.set_title(f"{model}: 2BW's runs of {', '.join(map(str, lengths))} steps against Flush's", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def replan() -> None:
    """The planner's 2BW/Flush rate ratios are its own output, not a measurement: every recorded row's ratios and the
    README's and quality page's lead table re-derived from today's planner (the measured step overheads unchanged)."""
    from lightning_pd2bw.planner.step_overhead import measured, record, summary_table, with_summary

    cache = ROOT / "outputs" / "delayed_rule" / "planned_rates.json"
    cache.unlink(missing_ok=True)
    planned = rates_planned()
    ratios = {label: round(plan["ratio"], 4) for label, plan in planned.items()}
    against = {label: plan.get("against", "Flush") for label, plan in planned.items()}  # the synchronous comparator
    slowdowns = {label: round(plan.get("slowdown", 1.0), 4) for label, plan in planned.items()}
    for model, entry in measured().items():
        replanned = entry | {"ratios": ratios, "against": against, "slowdowns": slowdowns}
        record(model, replanned)
        write_page(replanned)  # the table's time columns and the plot at today's ratios
    readme = ROOT / "README.md"
    readme.write_text(with_summary(readme.read_text()))
    (ROOT / "docs" / "_generated" / "time-to-quality-summary.md").write_text(summary_table() + "\n")
    print("planned:", ", ".join(f"{label} 2BW/{against[label]} {ratio:.3f}x" for label, ratio in ratios.items()))


def rates_planned() -> dict:
    """The planner's 2BW/Flush rates, cached beside the runs (``benchmarks/mode_rates.py``)."""
    from benchmarks.mode_rates import planned

    path = ROOT / "outputs" / "delayed_rule" / "planned_rates.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(planned(), indent=1))
    return json.loads(path.read_text())
