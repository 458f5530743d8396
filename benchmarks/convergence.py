"""Model quality at equal steps: Flush vs 2BW vs 2BW + delay correction, AdamW and Muon, several seeds, two corpora.

    python benchmarks/convergence.py                 # 3 seeds x 6 settings x 2 corpora, 300 steps each
    python benchmarks/convergence.py --steps 100 --seeds 1 --corpora stdlib   # a quick look
    python benchmarks/convergence.py --corpora packages --optimizers adamw \
        --settings flush,flush+lr1e-3,2bw+ef+lr1e-3,2bw+ef+lr1e-3+wu60    # a learning-rate / warm-up sweep
    python benchmarks/convergence.py --sweep sparsity      # docs/sparsity.md: 75% against dense (~8 h)
    python benchmarks/convergence.py --corpora packages --optimizers adamw --settings flush,2bw+ef \
        --stages 4 --horizons 1,1.1,1.2       # time to quality at depth 4 (below)

Every run is ``pd2bw-train`` as a user starts it (GPT tiny, 2 CPU processes, the same data order and
initialisation per seed for every setting). Validation every ``--val-every`` steps on held-out text (the
corpus's last 5%; each validation drains 2BW's pipeline, the same for every 2BW setting). Prints the final
validation loss per setting (mean and spread over seeds, gap to Flush with the same optimizer) and writes
``OUT/convergence.png`` (validation curves) and ``OUT/convergence.json``. Runs already finished under ``OUT``
are reused, so an interrupted benchmark continues where it stopped (a run it interrupted starts again).

Time to quality (``--horizons``): each setting but Flush also runs with ``trainer.max_steps`` (and with it the LR
and sparsity schedules) stretched by each factor. The target of seed k is Flush's final validation loss with seed k
(the same initialisation and data order). A setting's time to it is the training wall-clock (validations included,
start-up not) of the run length whose final loss equals the target, interpolated between the two lengths around it:
a run that stops there, schedules included, not a point in the middle of a longer schedule. Wall-clock comes from
the run's own log: each logged ``tokens_per_sec`` is the rate over the steps since the previous log. ``--stages`` sets the depth (one CPU process
per stage; more stages than cores share them).

Corpora: ``stdlib`` (the embedded corpus: Python source), ``packages`` (the English descriptions of the
Python packages installed next to this one: each ``*.dist-info/METADATA``; text no setting was tuned on) and
``copyrights`` (a Debian machine's ``/usr/share/doc/*/copyright`` files, each distinct text once: legal English held
out from the sparsity sweep's tuning) and ``fortunes`` (Debian's ``fortunes`` package: natural English, quotations,
literature and poems, where the validation loss follows the training loss; issue 64's corpus). Each run's line and
the table give the validation loss over the training loss (the mean of the last logs): near 0 where validation
follows training, far above where a model memorises its corpus.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: benchmarks.* importable
from benchmarks.comparator import width_flops  # noqa: E402
from benchmarks.convergence_settings import (  # noqa: E402
    MODELS,
    OPTIMIZERS,
    SWEEPS,
    flush_of,
    overrides,
)
from benchmarks.corpora import CORPORA  # noqa: E402

FRACTION = re.compile(r"=@([0-9.]+)$")  # "key=@0.25": a step given as a fraction of the run's steps
TRAIN_TAIL = 10  # the training loss a run ends at: the mean of its last 10 logs (the last 100 steps by default)
SPIKE_WINDOW = (
    10  # a step's train loss over the median of the WINDOW logged before it (tests/distributed/test_no_spikes)
)


def run(
    out: Path, corpus: str, optimizer: str, setting: str, seed: int, args: argparse.Namespace, steps: int | None = None
) -> Path:
    steps = steps or args.steps
    depth = "" if args.stages == 2 else f"-d{args.stages}"
    horizon = "" if steps == args.steps else f"-{steps}steps"
    model = "" if args.model == "gpt_tiny" else f"{args.model}-"
    folder = out / corpus / f"{model}{optimizer}-{setting}{depth}{horizon}-seed{seed}"
    if finished(folder):
        return folder
    settings = [f"model.optimizer={optimizer}", f"trainer.devices={args.stages}", "trainer.enable_checkpointing=false"]
    settings += [FRACTION.sub(lambda m: f"={round(float(m[1]) * steps)}", o) for o in overrides(setting)]
    return train(
        folder, args.model, corpus, out, steps, seed, settings, args.val_every, args.log_every, args.val_batches
    )


def train(
    folder: Path,
    model: str,
    corpus: str,
    out: Path,
    steps: int,
    seed: int,
    settings: list[str],
    val_every: int,
    log_every: int = 10,
    val_batches: str = "16",
) -> Path:
    """One ``pd2bw-train`` run into ``folder`` as a user starts it (``settings``: Hydra overrides, a ``recipe=``
    among them), the same data order and initialisation per seed; validation every ``val_every`` steps ending at
    the last, reading ``val_batches`` batches of the held-out split ("all": the whole split); ``corpus`` built under
    ``out``."""
    data = [] if corpus == "stdlib" else [f"data.paths=[{CORPORA[corpus](out)}]"]
    command = [
        sys.executable,
        "-m",
        "lightning_pd2bw.cli.train",
        *[s for s in settings if s.startswith("recipe=")],
        f"model={model}",
        f"data.seq_len={MODELS[model]}",
        f"trainer.max_steps={steps}",
        f"trainer.val_check_interval={val_interval(steps, val_every)}",
        f"trainer.limit_val_batches={'1.0' if val_batches == 'all' else int(val_batches)}",
        f"trainer.log_every_n_steps={log_every}",
        "trainer.enable_progress_bar=false",
        f"seed={seed}",
        f"model.config.seed={1234 + seed}",
        f"paths.output_dir={folder}",
        "strategy.sync_steps=0",  # 2BW from the first step unless the setting starts synchronously (+syncN)
        *[s for s in settings if not s.startswith("recipe=")],
        *data,
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
    return folder


def val_interval(steps: int, every: int) -> int:
    """The divisor of ``steps`` nearest ``every`` (the smaller on a tie): the last validation is the run's last step,
    whatever its length (a horizon of 2,200 steps validates every 275)."""
    return min((d for d in range(1, steps + 1) if steps % d == 0), key=lambda d: (abs(d - every), d))


def finished(folder: Path) -> bool:
    """Whether the run in ``folder`` finished (``pd2bw-train`` wrote its summary); the folder of one that was
    interrupted is removed, since its partial CSV log would be read with its rerun's."""
    if (folder / "summary.json").exists():
        return True
    shutil.rmtree(folder, ignore_errors=True)
    return False


def curve(folder: Path) -> list[tuple[int, float]]:
    """(step, val_loss) from the run's CSV log."""
    points = []
    for metrics in folder.glob("csv/*/metrics.csv"):
        with metrics.open() as f:
            for row in csv.DictReader(f):
                if row.get("val_loss"):
                    points.append((int(row["step"]), float(row["val_loss"])))
    return sorted(points)


def train_losses(folder: Path) -> list[float]:
    """The logged train losses, by step."""
    rows = []
    for metrics in folder.glob("csv/*/metrics.csv"):
        with metrics.open() as f:
            rows += [(int(r["step"]), float(r["train_loss"])) for r in csv.DictReader(f) if r.get("train_loss")]
    return [loss for _, loss in sorted(rows)]


def flops_ratio(folder: Path) -> float:
    """Training FLOPs per token against dense, averaged over the run: the mean of the logged
    ``sparsity/flops_ratio`` (the masks counted; attention scores and the head dense), 1.0 without sparsity."""
    return logged_mean(folder, "sparsity/flops_ratio")


def logged_mean(folder: Path, key: str, default: float = 1.0) -> float:
    """A logged metric averaged over a run's steps (``default`` where it was never logged). One value per step, the
    last: the final measurement at the end of training repeats the last log's step."""
    values: dict[int, float] = {}
    for metrics in folder.glob("csv/*/metrics.csv"):
        with metrics.open() as f:
            values |= {int(r["step"]): float(r[key]) for r in csv.DictReader(f) if r.get(key)}
    return statistics.mean(values.values()) if values else default


def worst_spike(losses: list[float], window: int = SPIKE_WINDOW) -> float:
    """The largest ratio of a logged train loss to the median of the ``window`` logged before it (1.0: none above)."""
    ratios = [losses[i] / statistics.median(losses[i - window : i]) for i in range(window, len(losses))]
    return max(ratios, default=1.0)


def seconds(folder: Path) -> list[tuple[int, float]]:
    """(step, training seconds since the first step) at each log of ``tokens_per_sec``: the rate over the steps since
    the previous log (Lightning's ``Throughput``, window 2), so each interval's time is its tokens over that rate."""
    config = yaml.safe_load((folder / "config.yaml").read_text())  # the run's resolved config
    tokens_per_step = config["global_batch_size"] * config["data"]["seq_len"]
    points, previous, total = [], -1, 0.0
    for metrics in folder.glob("csv/*/metrics.csv"):
        with metrics.open() as f:
            rows = sorted(
                (int(r["step"]), float(r["tokens_per_sec"])) for r in csv.DictReader(f) if r.get("tokens_per_sec")
            )
        for step, rate in rows:
            total += (step - previous) * tokens_per_step / rate
            points.append((step, total))
            previous = step
    return points


def horizon_to(target: float, horizons: list[tuple[int, float, float]]) -> tuple[float, float, bool] | None:
    """``horizons``: (steps, final loss, training seconds) of one seed's runs, by steps. The run length whose final
    loss is ``target``, interpolated between the two runs around it: (steps, seconds, bracketed); the shortest run
    if it already reaches the target (bracketed False: an upper bound); None if none reaches it."""
    for (s0, l0, t0), (s1, l1, t1) in zip([horizons[0], *horizons], horizons):
        if l1 <= target:
            if l0 <= target or s0 == s1:
                return s1, t1, False
            f = (l0 - target) / (l0 - l1)
            return s0 + f * (s1 - s0), t0 + f * (t1 - t0), True
    return None


def quality_times(results: dict[str, dict], prefix: str, baseline: str = "flush") -> str:
    """Time to quality for the runs under ``prefix`` (corpus/optimizer/): per setting and seed, the run length (LR
    schedule and all) whose final validation loss equals ``baseline``'s (Flush's, or dense's) with that seed, and its
    training time."""
    flush = results[f"{prefix}{baseline}"]
    targets, flush_times = flush["final"], [seconds(Path(f))[-1][1] for f in flush["runs"]]
    lines = [
        f"target: {baseline}'s final validation loss after {flush['steps']} steps, seed by seed "
        f"(mean {statistics.mean(targets):.4f}); {baseline}'s training time {statistics.mean(flush_times):.1f} s",
        f"| setting | final val loss per run length | steps to the target | training s to the target | vs {baseline} |",
        "|---|---|---|---|---|",
    ]

    def setting_of(key: str) -> str:  # "2bw+ef@360" -> "2bw+ef"
        return key[len(prefix) :].split("@")[0]

    settings = dict.fromkeys(setting_of(k) for k in results if k.startswith(prefix))
    for setting in settings:
        mine = [v for k, v in results.items() if k.startswith(prefix) and setting_of(k) == setting]
        runs = sorted(mine, key=lambda v: v["steps"])
        finals = ", ".join(f"{v['steps']}: {statistics.mean(v['final']):.4f}" for v in runs)
        found = []
        for seed, target in enumerate(targets):
            horizons = [(v["steps"], v["final"][seed], seconds(Path(v["runs"][seed]))[-1][1]) for v in runs]
            found.append(horizon_to(target, horizons))
        if any(f is None for f in found):
            lines.append(f"| {setting} | {finals} | not reached by {sum(f is None for f in found)} seed(s) | - | - |")
            continue
        bound = "" if all(f[2] for f in found) or setting == baseline else "<= "
        steps, time_s = statistics.mean(f[0] for f in found), statistics.mean(f[1] for f in found)
        ratio = statistics.mean(f[1] / t for f, t in zip(found, flush_times))
        lines.append(f"| {setting} | {finals} | {bound}{steps:.0f} | {bound}{time_s:.1f} | {ratio:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--val-every", type=int, default=50)
    parser.add_argument("--val-batches", default="16", help='held-out batches each validation reads ("all": every one)')
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0, help="seeds FIRST..FIRST+SEEDS-1 (add seeds to a record)")
    parser.add_argument("--corpora", default="stdlib,packages")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--settings", default="flush,2bw,2bw+ef")
    parser.add_argument("--stages", type=int, default=2, help="pipeline depth: CPU processes (trainer.devices)")
    parser.add_argument("--horizons", default="", help="time to quality: e.g. 1,1.2,1.4 (factors of --steps)")
    parser.add_argument("--model", default="gpt_tiny", choices=sorted(MODELS), help="the model preset (conf/model)")
    parser.add_argument("--log-every", type=int, default=10, help="train loss logged every N steps (1: every spike)")
    parser.add_argument("--baseline", help="the setting every gap is measured against (default: Flush alike)")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "convergence")
    parser.add_argument("--sweep", choices=sorted(SWEEPS), help="run a named sweep (its runs' arguments) instead")
    args = parser.parse_args()
    results: dict[str, dict] = {}
    for job in SWEEPS[args.sweep] if args.sweep else [{}]:
        vars(args).update(job)
        results |= collect(args)
    print(table(results, args.baseline))
    for corpus in args.corpora.split(",") if args.horizons else []:
        corpus = corpus if args.model == "gpt_tiny" else f"{corpus} ({args.model})"  # as collect() labels it
        for optimizer in args.optimizers.split(","):
            if f"{corpus}/{optimizer}/{args.baseline or 'flush'}" not in results:
                continue  # nothing to reach: the horizons alone (e.g. dense at a sparse run's FLOPs)
            print(f"\ntime to quality: {corpus}, {optimizer}, depth {args.stages}")
            print(quality_times(results, f"{corpus}/{optimizer}/", args.baseline or "flush"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "convergence.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out / "convergence.png", args.steps)


def seeds(args: argparse.Namespace) -> range:
    """The seeds ``args`` asks for (``--first-seed`` on: each seed's runs stand alone, so a record grows a seed)."""
    return range(args.first_seed, args.first_seed + args.seeds)


def collect(args: argparse.Namespace) -> dict[str, dict]:
    """Every run ``args`` asks for (reused where finished), by "corpus/optimizer/setting" (the corpus labelled with
    the model where it is not the tiny GPT)."""
    results: dict[str, dict] = {}
    factors = [float(h) for h in args.horizons.split(",") if h] or [1.0]
    for corpus in args.corpora.split(","):
        label = corpus if args.model == "gpt_tiny" else f"{corpus} ({args.model})"
        for optimizer in args.optimizers.split(","):
            for setting in args.settings.split(","):
                for factor in factors if setting not in ("flush", args.baseline) else [1.0]:
                    steps = round(args.steps * factor)
                    runs = [run(args.out, corpus, optimizer, setting, s, args, steps) for s in seeds(args)]
                    curves = [curve(f) for f in runs]
                    finals = [c[-1][1] for c in curves]
                    trains = [statistics.mean(train_losses(f)[-TRAIN_TAIL:]) for f in runs]
                    name = setting if steps == args.steps else f"{setting}@{steps}"
                    results[f"{label}/{optimizer}/{name}"] = {
                        "final": finals,
                        "train": trains,
                        "spike": max(worst_spike(train_losses(f)) for f in runs),
                        "flops": statistics.mean(flops_ratio(f) * width_flops(f, args.model) for f in runs),
                        "curves": curves,
                        "steps": steps,
                        "runs": [str(f) for f in runs],
                    }
                    tracks = " ".join(f"{100 * (v / t - 1):+.1f}%" for v, t in zip(finals, trains))
                    print(
                        f"{label:9s} {optimizer:6s} {name:12s} " + " ".join(f"{v:.4f}" for v in finals),
                        f"(validation over training, per run: {tracks})",
                        flush=True,
                    )
    return results


def table(results: dict[str, dict], baseline: str | None = None) -> str:
    """One row per setting; the gap is to Flush at the same rate and warm-up, or to ``baseline`` (e.g. dense)."""
    lines = [
        f"| corpus | optimizer | setting | val loss (mean ± sd) | vs {baseline or 'Flush'} (same optimizer) "
        "| per seed | validation over training | train FLOPs vs dense | worst spike |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for key, value in results.items():
        corpus, optimizer, setting = key.split("/")
        finals = value["final"]
        mean = statistics.mean(finals)
        spread = statistics.stdev(finals) if len(finals) > 1 else 0.0
        reference = baseline or flush_of(setting)
        if not baseline and f"{corpus}/{optimizer}/{reference}" not in results:
            reference = "flush"  # no Flush run at this rate and warm-up: the gap says which it is against
        flush = results.get(f"{corpus}/{optimizer}/{reference}")
        gap = f"{100 * (mean / statistics.mean(flush['final']) - 1):+.2f}%" if flush else "-"
        gap += "" if not flush or baseline or reference == flush_of(setting) else " (vs flush)"
        seeds = zip(finals, flush["final"]) if flush else []  # seed k against seed k (same init and data order)
        per_seed = ", ".join(f"{100 * (v / f - 1):+.2f}%" for v, f in seeds) or "-"
        trains = value.get("train")
        tracks = f"{100 * statistics.mean(v / t - 1 for v, t in zip(finals, trains)):+.1f}%" if trains else "-"
        spike = f"{value['spike']:.2f}x" if "spike" in value else "-"
        flops = f"{value['flops']:.2f}" if "flops" in value else "-"
        lines.append(
            f"| {corpus} | {optimizer} | {setting} | {mean:.4f} ± {spread:.4f} | {gap} | {per_seed} | {tracks} "
            f"| {flops} | {spike} |"
        )
    return "\n".join(lines)


def plot(results: dict[str, dict], path: Path, steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    corpora = sorted({k.split("/")[0] for k in results})
    fig, axes = plt.subplots(1, len(corpora), figsize=(6 * len(corpora), 4), squeeze=False)
    settings = list(dict.fromkeys(k.split("/")[2] for k in results))
    colors = {setting: f"C{i % 10}" for i, setting in enumerate(settings)}  # a color per setting
    styles = {"adamw": "-", "muon": "--"}  # a line style per optimizer
    for ax, corpus in zip(axes[0], corpora):
        shown: list[float] = []
        for key, value in results.items():
            c, optimizer, setting = key.split("/")
            if c != corpus or not value["curves"][0]:
                continue
            steps_axis = [s for s, _ in value["curves"][0]]
            mean = [statistics.mean(curve[i][1] for curve in value["curves"]) for i in range(len(steps_axis))]
            ax.plot(steps_axis, mean, styles[optimizer], color=colors[setting], label=f"{optimizer} {setting}")
            shown += [m for s, m in zip(steps_axis, mean) if s >= steps / 3]
        ax.set_title(f"{corpus}: validation loss (mean over seeds)")
        ax.set_xlabel("step")
        ax.set_xlim(steps / 3, steps)  # the last two thirds: where the settings part
        if shown:
            ax.set_ylim(min(shown) - 0.01, max(shown) + 0.01)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
