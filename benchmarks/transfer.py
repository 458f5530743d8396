"""Sparse pre-training, then dense fine-tuning on text it never saw (SPDF's claim), and pruning a trained model
while fine-tuning it (issue 65, items 2 and 3).

    python benchmarks/transfer.py                       # the tiny GPT, 2 seeds (about an hour here)
    python benchmarks/transfer.py --model gpt_small --pretrain-steps 1000 --finetune-steps 300
    python benchmarks/transfer.py --model gpt_small --pretrain-steps 1000 --finetune-steps 300 --sparse sparse75 \
        --parts equal-flops,short --rates 1   # GPT small's equal-FLOPs control alone (about 45 minutes a seed here)

SPDF (Thangarasa et al. 2023) claims that a model pre-trained 75% sparse and then fine-tuned densely on a downstream
task matches the dense-pretrained model after the same fine-tuning. Per seed, as a user runs it (``pd2bw-train``,
2 CPU processes, the product's defaults but the synchronous start: 2BW with its correction from the first step, AdamW):

1. pre-training on ``--pretrain`` (``stdlib``: the embedded corpus, Python source) for ``--pretrain-steps``: dense,
   75% sparse with the default gradual schedule (``sparsity=gradual``), and 75% static (random masks from step 0,
   ``sparsity=static``, SPDF's own setting), each saving its checkpoint;
2. dense fine-tuning of each on ``--finetune`` (``fortunes``: natural English none of them saw) for
   ``--finetune-steps`` from its weights (``init_from=``: a fresh optimizer, schedule and step; the masks do not
   come along, so the pruned weights grow back from zero), at a fine-tune's rate (a third of pre-training's, warmed
   up over 2% of the run); the same fine-tune from scratch is the control that pre-training matters;
3. pruning the dense pre-trained model to 50% and 75% while fine-tuning it (``recipe=prune``, the same steps and
   rate): the common case of taking a trained model and making it sparse; at 75% also from the same model written as
   a Hugging Face GPT-2 directory (``pd2bw-consolidate --format hf``: how a user starts from GPT-2's weights);
4. the fair comparator of Jin et al. (ICLR 2025): per sparse pre-training, a dense GPT of equal average parameter
   count (the non-embedding parameters, averaged over the pre-training steps from the logged density; the width
   ``n_embd`` that matches it, the depth and heads kept), pre-trained and fine-tuned alike;
5. the equal-FLOPs control: the full-width dense model pre-trained for each sparse run's FLOPs (its steps times the
   sparse run's logged FLOPs ratio, the cosine stretched to that length by ``trainer.max_steps``), fine-tuned alike:
   whether sparse pre-training beats shorter dense training; and for every full-width pre-training a short fine-tune
   (``--short-finetune-steps``, 100), compared with the dense model's short fine-tune.

Every pre-training (dense, sparse, comparator) runs at its own best peak rate: seed 0 pre-trains it at each of
``--rates`` (multiples of the model's rate) and the lowest pre-training validation loss picks the rate every seed of
that row uses, its fine-tunes at a third of it; the equal-FLOPs controls, the pruning and the fine-tune from scratch
take the dense model's.

Prints per run the final validation loss on the fine-tuning corpus, each seed against the dense-pretrained fine-tune
of the same seed, and the pre-training's training FLOPs against dense (the masks counted). Runs already finished
under ``--out`` are reused.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: benchmarks.* importable

from benchmarks.comparator import dense_flops, equal_params_width  # noqa: E402
from benchmarks.convergence import curve, finished, flops_ratio, logged_mean  # noqa: E402
from benchmarks.convergence import train as run_training  # noqa: E402
from benchmarks.corpora import CORPORA  # noqa: E402

PRETRAINING = {  # name -> pd2bw-train overrides
    "dense": ["sparsity=none"],
    "sparse75": ["sparsity=gradual", "sparsity.sparsity=0.75"],  # the default schedule, at 75%
    "static75": ["sparsity=static", "sparsity.sparsity=0.75"],  # SPDF's: a random mask from step 0
}
PRUNED = {"prune50": 0.5, "prune75": 0.75}  # recipe=prune from the dense pre-trained model, to this sparsity
MODELS = ("gpt_small", "gpt_tiny")
PARTS = ("comparators", "equal-flops", "short", "scratch", "pruning")  # the rows beside dense and sparse (all default)


def peak_lr(model: str) -> float:
    """Pre-training's peak rate: ``conf/model/MODEL.yaml``'s ``lr``, or the one it inherits through ``defaults``."""
    spec = yaml.safe_load((ROOT / "conf" / "model" / f"{model}.yaml").read_text())
    if "lr" in spec:
        return float(spec["lr"])
    return peak_lr(next(name for name in spec["defaults"] if name != "_self_" and not name.endswith("_schema")))


def train(folder: Path, args: argparse.Namespace, seed: int, steps: int, corpus: str, extra: list[str]) -> Path:
    """One ``pd2bw-train`` run into ``folder`` (reused where it finished; checkpoints on: a fine-tune starts there)."""
    if finished(folder):
        return folder
    return run_training(
        folder, args.model, corpus, args.out, steps, seed, ["trainer.devices=2", *extra], args.val_every
    )


def fine_tune(args: argparse.Namespace, steps: int | None = None, peak: float | None = None) -> list[str]:
    """A fine-tune's rate and warm-up (the prune recipe's rule: a third of pre-training's peak, 2% warm-up)."""
    return [
        f"model.lr={(peak or peak_lr(args.model)) / 3:.3g}",
        f"model.warmup_steps={max(1, round(0.02 * (steps or args.finetune_steps)))}",
    ]


def rate_suffix(args: argparse.Namespace, rate: float) -> str:
    """A run's name suffix: its peak rate itself, never relative to the model's (a change of the model's default rate
    must not make a finished run pass for one at the new rate)."""
    return f"-lr{rate:g}"


def at_rate(args: argparse.Namespace, rate: float) -> list[str]:
    """The override of a pre-training's peak rate (stated even at the model's own, as its name is)."""
    return [f"model.lr={rate:g}"]


def rate_sweep(args: argparse.Namespace, name: str, overrides: list[str]) -> dict[float, float]:
    """Seed 0's pre-training ``name`` at each of ``--rates`` times the model's peak rate: rate -> its final
    validation loss on the pre-training corpus (the lowest is the rate every seed of that row uses)."""
    sweep = {}
    for factor in args.rates:
        rate = float(f"{factor * peak_lr(args.model):.3g}")
        folder = args.out / args.model / f"pretrain-{name}{rate_suffix(args, rate)}-seed0"
        settings = [*overrides, *at_rate(args, rate)]
        sweep[rate] = curve(train(folder, args, 0, args.pretrain_steps, args.pretrain, settings))[-1][1]
    return sweep


def runs(args: argparse.Namespace, seed: int) -> dict[str, dict]:
    """Every run of one seed: name -> its final fine-tuning validation loss, its pre-training's final validation loss,
    peak rate and FLOPs per token against dense, and the run it is compared with (``baseline``). Every pre-training
    runs at its own best peak rate of seed 0's sweep (the equal-FLOPs controls, the pruning and the fine-tune from
    scratch at the dense model's)."""
    out, results = args.out / args.model, {}
    tune = (args.finetune_steps, args.finetune)
    pretraining: dict[str, tuple[list[str], int, float, dict]] = {}  # row -> overrides, steps, peak rate, sweep

    def pretrain(name: str, overrides: list[str], steps: int, rate: float) -> Path:
        folder = out / f"pretrain-{name}{rate_suffix(args, rate)}-seed{seed}"
        return train(folder, args, seed, steps, args.pretrain, [*overrides, *at_rate(args, rate)])

    def tuned_row(name: str, overrides: list[str]) -> None:
        sweep = rate_sweep(args, name, overrides)
        pretraining[name] = (overrides, args.pretrain_steps, min(sweep, key=sweep.get), sweep)

    def record(name: str, tuned: Path, flops: float, pretrained: Path | None, rate: float, baseline: str = "dense"):
        results[name] = {
            "final": curve(tuned)[-1][1],
            "flops": flops,
            "pretrain": pretrained and curve(pretrained)[-1][1],
            "rate": rate,
            "baseline": baseline,
        }

    for name in ["dense", *args.sparse]:
        tuned_row(name, PRETRAINING[name])
    dense_rate = pretraining["dense"][2]

    def sparse_run(name: str) -> Path:
        overrides, steps, rate, _ = pretraining[name]
        return pretrain(name, overrides, steps, rate)

    for name in args.sparse if "comparators" in args.parts else ():  # a dense GPT of equal average parameters each
        width = equal_params_width(args.model, logged_mean(sparse_run(name), "sparsity/density"))
        tuned_row(f"dense{width}-{name}", ["sparsity=none", f"model.config.n_embd={width}"])
    # the equal-FLOPs control: the full-width dense model pre-trained for the sparse run's FLOPs (fewer steps, its
    # schedule stretched to them by trainer.max_steps), fine-tuned alike: does sparsity beat shorter dense training?
    for name in args.sparse if "equal-flops" in args.parts else ():
        steps = round(flops_ratio(sparse_run(name)) * args.pretrain_steps)
        pretraining[f"dense-{steps}steps"] = (PRETRAINING["dense"], steps, dense_rate, {})
    short = (args.short_finetune_steps, args.finetune)
    for name, (overrides, steps, rate, sweep) in pretraining.items():
        folder, width = pretrain(name, overrides, steps, rate), [o for o in overrides if o.startswith("model.config.")]
        start = f"init_from={folder / 'checkpoints' / 'last.ckpt'}"
        settings = ["sparsity=none", start, *width, *fine_tune(args, peak=rate)]
        tuned = train(out / f"finetune-{name}{rate_suffix(args, rate)}-seed{seed}", args, seed, *tune, settings)
        if width:
            flops = dense_flops(args.model, int(width[0].split("=")[1]))
        else:
            flops = flops_ratio(folder) * steps / args.pretrain_steps
        record(name, tuned, flops, folder, rate)
        if sweep:
            results[name]["sweep"] = sweep
        if "short" in args.parts and args.short_finetune_steps and not width:  # less room to wash a gap out
            short_settings = ["sparsity=none", start, *fine_tune(args, args.short_finetune_steps, peak=rate)]
            where = out / f"finetune{short[0]}-{name}{rate_suffix(args, rate)}-seed{seed}"
            shortened = train(where, args, seed, *short, short_settings)
            record(f"{name}, fine-tune {short[0]}", shortened, flops, folder, rate, f"dense, fine-tune {short[0]}")
    scratch_tune = fine_tune(args, peak=dense_rate)
    if "scratch" in args.parts:
        scratch = train(
            out / f"finetune-scratch{rate_suffix(args, dense_rate)}-seed{seed}",
            args,
            seed,
            *tune,
            ["sparsity=none", *scratch_tune],
        )
        record("scratch", scratch, 0.0, None, dense_rate)
    if "pruning" not in args.parts:
        return results
    dense = out / f"pretrain-dense{rate_suffix(args, dense_rate)}-seed{seed}"
    gpt2 = dense / "gpt2"  # the dense model written as a Hugging Face GPT-2 directory
    if not (gpt2 / "config.json").is_file():
        export = [sys.executable, "-m", "lightning_pd2bw.cli.consolidate", str(dense / "checkpoints" / "last.ckpt")]
        subprocess.run([*export, str(gpt2), "--format", "hf"], check=True)
    for name, source in [*((n, dense / "checkpoints" / "last.ckpt") for n in PRUNED), ("prune75-gpt2", gpt2)]:
        overrides = ["recipe=prune", f"init_from={source}", f"sparsity.sparsity={PRUNED[name[:7]]}", *scratch_tune]
        where = out / f"finetune-{name}{rate_suffix(args, dense_rate)}-seed{seed}"
        record(name, train(where, args, seed, *tune, overrides), 1.0, dense, dense_rate)
    return results


def table(per_seed: list[dict[str, dict]], args: argparse.Namespace) -> str:
    lines = [
        f"{args.model}: pre-training {args.pretrain_steps} steps on {args.pretrain}, fine-tuning {args.finetune_steps} "
        f"steps on {args.finetune}; validation loss on {args.finetune}, seeds {', '.join(map(str, range(args.seeds)))}",
        "",
        "| pre-training | peak rate | pre-training val loss | pre-training FLOPs vs dense | fine-tuned val loss, per seed "
        "| vs dense-pretrained (same fine-tune), per seed | mean |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in per_seed[0]:
        finals = [seed[name]["final"] for seed in per_seed]
        gaps = [100 * (seed[name]["final"] / seed[seed[name]["baseline"]]["final"] - 1) for seed in per_seed]
        pre = [seed[name]["pretrain"] for seed in per_seed]
        pretrain = " / ".join(f"{p:.4f}" for p in pre) if pre[0] is not None else "-"
        flops = statistics.mean(seed[name]["flops"] for seed in per_seed)
        lines.append(
            f"| {name} | {per_seed[0][name]['rate']:g} | {pretrain} | {flops:.2f} | {' / '.join(f'{f:.4f}' for f in finals)} "
            f"| {' / '.join(f'{g:+.2f}%' for g in gaps)} | {statistics.mean(gaps):+.2f}% |"
        )
    for name, row in per_seed[0].items():
        if len(row.get("sweep", {})) > 1:  # the row's rate, chosen on seed 0
            points = ", ".join(f"{rate:g}: {loss:.4f}" for rate, loss in sorted(row["sweep"].items()))
            lines.append(f"\n{name}'s peak rate, seed 0's pre-training validation loss at each: {points}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt_tiny", choices=MODELS)
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--pretrain", default="stdlib", choices=["stdlib", *CORPORA])
    parser.add_argument("--finetune", default="fortunes", choices=["stdlib", *CORPORA])
    parser.add_argument("--pretrain-steps", type=int, default=2000)
    parser.add_argument("--finetune-steps", type=int, default=500)
    parser.add_argument("--short-finetune-steps", type=int, default=100, help="the short fine-tune rows (0: none)")
    parser.add_argument("--val-every", type=int, default=250)
    parser.add_argument(
        "--rates",
        type=lambda text: [float(x) for x in text.split(",")],
        default=[0.5, 1.0, 2.0],
        help="every pre-training's peak-rate sweep on seed 0, as multiples of the model's rate (1: none)",
    )
    parser.add_argument(
        "--sparse", type=lambda text: text.split(","), default=["sparse75", "static75"], help="sparse pre-trainings"
    )
    parser.add_argument(
        "--parts",
        type=lambda text: text.split(","),
        default=list(PARTS),
        help=f"which rows besides dense and the sparse pre-trainings: a subset of {','.join(PARTS)}",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "transfer")
    parser.add_argument("--record", action="store_true", help="write the table where docs/sparsity.md reads it")
    args = parser.parse_args()
    per_seed = []
    for seed in range(args.seeds):
        per_seed.append(runs(args, seed))
        print(f"seed {seed}: " + ", ".join(f"{k} {v['final']:.4f}" for k, v in per_seed[-1].items()), flush=True)
    text = table(per_seed, args)
    print(text)
    if args.record:  # the one source of the docs' table (docs/sparsity.md includes it)
        import datetime
        import textwrap

        command = " \\\n    ".join(textwrap.wrap("python benchmarks/transfer.py " + " ".join(sys.argv[1:]), 100))
        out = ROOT / "docs" / "_generated" / f"transfer-{args.model}.md"
        today = datetime.date.today().isoformat()
        out.write_text(f"{today}, [the 2-core CPU machine](benchmarks.md#machines):\n\n```\n{command}\n```\n\n{text}\n")


if __name__ == "__main__":
    main()
