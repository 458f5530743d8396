"""2BW's update rule against the synchronous one in one process: the delay measured at sizes the pipeline benchmarks
cannot reach on a CPU (issue 64, item 4).

    python benchmarks/delayed_rule.py --model gpt_small --corpus fortunes --steps 1000 --seeds 1
    python benchmarks/delayed_rule.py --model gpt_small --preset gpt2 --seq-len 1024 --device cuda \
        --steps 2000 --val-every 250 --seeds 1          # GPT-2 124M-shaped, on a GPU (bf16 autocast)
    python benchmarks/delayed_rule.py ... strategy.delay_correction_strength=0.75 model.lr=3e-4   # Hydra overrides

Each rule trains the same model from the same initialisation on the same batches with the product's optimizers,
schedules and clipping, composed by Hydra as ``pd2bw-train`` composes them (``recipe=tiny``, the model preset, the
overrides given), one batch of ``global_batch_size`` sequences per step:

- ``sync``: the gradient of batch t at W(t), then the optimizers' step (what Flush and one GPU compute);
- ``2bw``: the gradient of batch t at W(t-1), the weight version 2BW's pipeline reads in its steady state, the
  optimizers' step on W(t), then ``strategy.delay_correction`` with the engine's own ``ErrorFeedback``. Validation
  is a drain, as in the pipeline: the update after it has a fresh gradient and restarts the correction's history.

The batches come in pd2bw-train's order (Lightning's sampler at width 1), so the first steps' losses equal those
of a 2-process pd2bw-train run in either mode to 5 digits (the loss 2BW logs at step k is batch k-1's).
The pipeline of any depth computes the 2BW rule this loop computes (its equivalence tests against the
single-process reference, ``tests/distributed/reference.py``); this loop is tested against a hand-computed delayed
SGD (``tests/unit/test_delayed_rule.py``). Prints per seed the final validation loss of each rule and 2BW's gap,
and writes ``OUT/delayed_rule.json`` (curves included); finished runs under ``--out`` are reused. With
``--horizons``, the time to quality (``time_to_quality.py``; ``--record`` writes it where the docs read it).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: benchmarks.* importable

from lightning_pd2bw.engine.updates.delay_correction import ErrorFeedback  # noqa: E402

RULES = ("sync", "2bw")


class DelayedRule:
    """One process's optimizer steps under ``rule``: ``step(loss_of)`` takes the gradient of ``loss_of(model)`` at the
    weights the rule reads (W(t), or W(t-1) under ``2bw``), steps ``optimizers`` and ``schedulers`` on W(t) after
    clipping the gradients' norm to ``clip``, then applies ``correction`` (a ``delay_correction`` method or None).
    ``sync_steps`` K: a synchronous start, K updates with fresh gradients (Flush's rule), then 2BW from a drain, as
    the pipeline switches: its first update is fresh too, so update K+1 (counting from 0) is the first to read
    W(t-1), and the correction's history starts there."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        schedulers: Sequence = (),
        rule: str = "2bw",
        correction: str | None = "predictive_error_feedback",
        strength: float = 1.0,
        clip: float | None = None,
        sync_steps: int = 0,
    ) -> None:
        if rule not in RULES:
            raise ValueError(f"rule={rule!r}: one of {RULES}")
        if sync_steps < 0:
            raise ValueError(f"sync_steps={sync_steps}: the number of fresh-gradient updates before 2BW's, >= 0")
        self.model, self.optimizers, self.schedulers = model, list(optimizers), list(schedulers)
        self.rule, self.clip, self.sync_steps, self.updates = rule, clip, sync_steps, 0
        self.params = [p for p in model.parameters() if p.requires_grad]
        delayed = rule == "2bw"
        self.correction = (
            ErrorFeedback.for_method(correction, self.params, strength) if correction and delayed else None
        )
        self.previous: list[torch.Tensor] | None = None  # W(t-1); None after a drain (the next gradient is fresh)
        self.norms: list[float] = []  # each update's gradient norm before clipping (how often clipping acts)

    def drain(self) -> None:
        """The pipeline empties (validation, the end): the next update's gradient is of the newest weights."""
        self.previous = None

    def step(self, loss_of: Callable[[torch.nn.Module], torch.Tensor]) -> float:
        # W(t), kept only where the rule reads another version: the step's base, the correction's and next W(t-1)
        now = [p.detach().clone() for p in self.params] if self.rule == "2bw" else None
        stale = self.rule == "2bw" and self.previous is not None and self.updates > self.sync_steps
        if stale:
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in self.params], self.previous)  # read W(t-1)
        loss = loss_of(self.model)
        loss.backward()
        if stale:
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in self.params], now)  # the step is on W(t)
        if self.clip:
            self.norms.append(torch.nn.utils.clip_grad_norm_(self.params, self.clip).item())
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if self.correction is not None:
            self.correction.apply(now, stale)
        for scheduler in self.schedulers:
            scheduler.step()
        self.previous = now
        self.updates += 1
        return loss.item()


def rule_overrides(overrides: Sequence[str], rule: str) -> list[str]:
    """The Hydra overrides ``rule`` runs with: those without a rule prefix, and those prefixed ``rule:``
    (``sync:model.lr=2e-3 2bw:model.lr=1e-3``: each rule at its own tuned rate)."""
    kept = []
    for override in overrides:
        prefix, _, rest = override.partition(":")
        if prefix in RULES and rest:
            kept += [rest] if prefix == rule else []
        else:
            kept.append(override)
    return kept


def compose(args: argparse.Namespace, seed: int, steps: int | None = None, rule: str = "2bw"):
    """The run's config as ``pd2bw-train`` composes it: ``recipe=tiny``, the model, the corpus and the overrides;
    ``steps`` (default ``--steps``) stretches the schedules with ``trainer.max_steps``."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from benchmarks.convergence_settings import MODELS
    from benchmarks.corpora import CORPORA
    from lightning_pd2bw.cli.train import CONF, RECIPES, setup_hydra

    setup_hydra()
    overrides = [
        f"model={args.model}",
        f"trainer.max_steps={steps or args.steps}",
        f"seed={seed}",
        f"model.config.seed={1234 + seed}",
        *([f"model.config.name={args.preset}"] if args.preset else []),
        f"data.seq_len={args.seq_len or MODELS.get(args.model, 128)}",
        *([] if args.corpus == "stdlib" else [f"data.paths=[{CORPORA[args.corpus](args.out)}]"]),
        *rule_overrides(args.overrides, rule),
    ]
    with initialize_config_dir(str(RECIPES), version_base="1.3"):
        return hydra_compose("tiny", overrides=[*overrides, f"hydra.searchpath=[file://{CONF}]"])


def batches(dataset: torch.utils.data.Dataset, batch_size: int, seed: int) -> Iterator[dict[str, torch.Tensor]]:
    """The training batches in ``pd2bw-train``'s order at width 1: Lightning's ``DistributedSampler`` (shuffled,
    seeded by the run's seed, one permutation per epoch), full batches."""
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size, sampler=sampler, drop_last=True)
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        yield from loader


def train(
    args: argparse.Namespace,
    rule: str,
    seed: int,
    steps: int | None = None,
    probe: Callable[[int, DelayedRule, Callable[[torch.nn.Module], torch.Tensor]], None] | None = None,
) -> dict:
    """One run of ``rule`` over ``steps`` (default ``--steps``): validation curve (the last point over the whole
    held-out split), training losses, seconds. ``probe(step, loop, loss_of_batch)`` runs after each update (e.g.
    ``benchmarks/sharpness.py``'s measurement on that step's batch)."""
    import lightning.pytorch as pl
    from hydra.utils import instantiate

    steps = steps or args.steps
    cfg = compose(args, seed, steps, rule)
    pl.seed_everything(cfg.seed, workers=True)
    model = instantiate(cfg.model)
    model.configure_model()
    model.to(args.device)
    data = instantiate(cfg.data, batch_size=cfg.global_batch_size)
    data.setup("fit")
    configured = model.configure_optimizers()
    entries = configured if isinstance(configured, list) else [configured]
    optimizers = [e["optimizer"] if isinstance(e, dict) else e for e in entries]
    schedulers = [e["lr_scheduler"]["scheduler"] for e in entries if isinstance(e, dict) and "lr_scheduler" in e]
    strategy = cfg.strategy
    loop = DelayedRule(
        model,
        optimizers,
        schedulers,
        rule,
        strategy.get("delay_correction"),
        strategy.get("delay_correction_strength", 1.0),
        cfg.trainer.gradient_clip_val,
        args.sync_steps,
    )
    autocast = torch.autocast(torch.device(args.device).type, torch.bfloat16, enabled=args.device.startswith("cuda"))

    def on_device(batch: dict) -> dict:
        return {k: v.to(args.device, non_blocking=True) for k, v in batch.items()}

    def loss_of(batch: dict) -> Callable[[torch.nn.Module], torch.Tensor]:
        def compute(m: torch.nn.Module) -> torch.Tensor:
            with autocast:
                return m.pipeline_loss(m(batch["input_ids"]), batch)

        return compute

    @torch.no_grad()
    def validate(whole: bool) -> float:
        """The mean loss of ``--val-batches`` held-out batches, or of all of them (``whole``: the run's end)."""
        model.eval()
        losses = []
        for i, batch in enumerate(data.val_dataloader()):
            if i == args.val_batches and not whole:
                break
            losses.append(loss_of(on_device(batch))(model).item())
        model.train()
        loop.drain()
        return statistics.mean(losses)

    curve, train_losses, start = [], [], time.perf_counter()
    order = cfg.seed if args.data_seed is None else args.data_seed
    stream = batches(data.train_set, cfg.global_batch_size, order)
    for step in range(1, steps + 1):
        loss_of_batch = loss_of(on_device(next(stream)))
        train_losses.append(loop.step(loss_of_batch))
        if probe is not None:
            probe(step, loop, loss_of_batch)
        if step % args.val_every == 0 or step == steps:
            curve.append((step, validate(whole=step == steps)))
            print(f"  {rule} seed {seed} step {step}: val {curve[-1][1]:.4f}", flush=True)
    return {"curve": curve, "train": train_losses, "seconds": time.perf_counter() - start, "norms": loop.norms}


def run_label(args: argparse.Namespace, rule: str, steps: int | None = None) -> str:
    """The name of ``rule``'s runs under these arguments (``steps``: a horizon's length, default ``--steps``). The
    synchronous rule reads no ``strategy.*`` key (the delay correction's) nor ``--sync-steps``, so one sync run
    serves every screen of those keys."""
    order = [] if args.data_seed is None else [f"order{args.data_seed}"]
    overrides = [o for o in rule_overrides(args.overrides, rule) if rule != "sync" or not o.startswith("strategy.")]
    start = [f"sync{args.sync_steps}"] if rule == "2bw" and getattr(args, "sync_steps", 0) else []
    parts = [args.model, args.preset or "", args.corpus, str(steps or args.steps), *order, *start, *overrides]
    return "-".join(parts).replace("/", "_")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt_small", help="conf/model/NAME (its optimizer, rate, warm-up)")
    parser.add_argument("--preset", help="another GPTConfig preset for the model's shape (gpt2: GPT-2 124M-shaped)")
    parser.add_argument("--seq-len", type=int, help="data.seq_len (default: the convergence benchmark's)")
    parser.add_argument("--corpus", default="fortunes", help="stdlib, packages, copyrights or fortunes")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--val-every", type=int, default=250)
    parser.add_argument(
        "--val-batches", type=int, default=16, help="held-out batches read at each validation but the last (all)"
    )
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument(
        "--train-seeds", help="train only these of the seeds (e.g. 1,2: one process per seed); report when all are done"
    )
    parser.add_argument("--data-seed", type=int, help="the batch order's seed (default: the run's, as pd2bw-train)")
    parser.add_argument(
        "--recorded-seeds",
        type=int,
        default=0,
        help="the first K seeds' final losses from step_overhead.json's record of these settings (runs of an earlier "
        "session whose files are gone), the others trained or read from --out",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "delayed_rule")
    parser.add_argument("--rules", default=",".join(RULES), help="the rules to run (finished ones are reused)")
    parser.add_argument("--sync-steps", type=int, default=0, help="2BW's synchronous start: K fresh updates first")
    parser.add_argument(
        "--lever", default="", help="with --record: the lever the overrides try (e.g. '2BW beta1 0.95')"
    )
    parser.add_argument(
        "--horizons",
        default="1",
        help="2BW's run lengths as factors of --steps, schedules stretched (e.g. 1,1.1,1.25): time to sync's loss",
    )
    parser.add_argument(
        "--record",
        action="store_true",
        help="write the time to quality where the docs and pd2bw-plan read it (docs/_generated/, planner/step_overhead.json)",
    )
    parser.add_argument(
        "--replan",
        action="store_true",
        help="only re-derive every recorded row's planned 2BW/Flush ratios from today's planner (no training)",
    )
    parser.add_argument(
        "--rates",
        choices=("planned", "measured"),
        default="planned",
        help="time to quality at the planner's 2BW/Flush rates only, or at this machine's measured one too",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        help="Hydra overrides, as pd2bw-train takes them; 'sync:KEY=V' or '2bw:KEY=V' for one rule",
    )
    args = parser.parse_args()
    if args.replan:
        from benchmarks.time_to_quality import replan

        replan()
        return
    rules = args.rules.split(",")
    if unknown := set(rules) - set(RULES):
        parser.error(f"--rules: {sorted(unknown)} unknown; the rules are {RULES}")
    lengths = sorted({round(args.steps * float(f)) for f in args.horizons.split(",")})
    args.out.mkdir(parents=True, exist_ok=True)
    if args.corpus != "stdlib":
        from benchmarks.corpora import CORPORA, corpus_digest

        print(f"corpus {args.corpus}: {corpus_digest(CORPORA[args.corpus](args.out))}", flush=True)
    label = run_label(args, "2bw")
    results = {}
    if args.recorded_seeds:
        from benchmarks.time_to_quality import recorded_results

        results = recorded_results(args, lengths, args.recorded_seeds)
    training = {int(s) for s in args.train_seeds.split(",")} if args.train_seeds else set(range(args.seeds))
    training -= set(range(args.recorded_seeds))
    for seed in range(args.seeds):
        for rule in RULES:
            for steps in [args.steps] if rule == "sync" else lengths:
                path = args.out / f"{run_label(args, rule, steps)}-{rule}-seed{seed}.json"
                if seed < args.recorded_seeds:
                    continue  # from the record
                if not path.exists() and rule in rules and seed in training:
                    path.write_text(json.dumps(train(args, rule, seed, steps)))
                if path.exists():
                    results[f"{rule}@{steps}/seed{seed}"] = json.loads(path.read_text())
    needed = [f"{rule}@{args.steps}/seed{seed}" for rule in RULES for seed in range(args.seeds)]
    if any(key not in results for key in needed):  # a longer horizon may be missing where a seed reached it before
        print(f"{label}: ran {sorted(results)}; the gap needs both rules (--rules {','.join(RULES)})")
        return
    gaps = []
    for seed in range(args.seeds):
        sync = results[f"sync@{args.steps}/seed{seed}"]
        late = results.get(f"2bw@{args.steps}/seed{seed}")
        if late is None:
            continue  # no 2BW run of sync's length: the time to quality alone
        gaps.append(100 * (late["curve"][-1][1] / sync["curve"][-1][1] - 1))
        seconds = f"{sync['seconds']:.0f} s / {late['seconds']:.0f} s"
        print(
            f"seed {seed}: sync {sync['curve'][-1][1]:.4f}, 2bw {late['curve'][-1][1]:.4f}, "
            f"2BW vs sync {gaps[-1]:+.2f}% ({seconds})"
        )
    if gaps:
        print(f"{label}: 2BW vs sync at equal steps, mean {statistics.mean(gaps):+.2f}% over {len(gaps)} seed(s)")
    report = {"label": label, "runs": results, "gaps": gaps}
    if len(lengths) > 1:
        from benchmarks.mode_rates import rates
        from benchmarks.time_to_quality import rates_planned, record, time_to_quality

        found = rates(args.model, args.corpus, args.out) if args.rates == "measured" else {"planned": rates_planned()}
        ratios = {label: plan["ratio"] for label, plan in found["planned"].items()}
        if "measured" in found:
            ratios = {"measured here, 2 CPU processes": found["measured"]["ratio"], **ratios}
        table, _ = time_to_quality(results, args, lengths, ratios)
        print(f"\ntime to quality: 2BW against sync's final validation loss (< 1: 2BW is there sooner)\n{table}")
        report |= {"time_to_quality": table, "ratios": ratios}
        if args.record:
            record(args, results, lengths, ratios)
    (args.out / "delayed_rule.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
