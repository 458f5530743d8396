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
and writes ``OUT/delayed_rule.json`` (curves included); finished runs under ``--out`` are reused.
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

from lightning_pd2bw.engine.delay_correction import ErrorFeedback  # noqa: E402

RULES = ("sync", "2bw")


class DelayedRule:
    """One process's optimizer steps under ``rule``: ``step(loss_of)`` takes the gradient of ``loss_of(model)`` at the
    weights the rule reads (W(t), or W(t-1) under ``2bw``), steps ``optimizers`` and ``schedulers`` on W(t) after
    clipping the gradients' norm to ``clip``, then applies ``correction`` (a ``delay_correction`` method or None)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        schedulers: Sequence = (),
        rule: str = "2bw",
        correction: str | None = "predictive_error_feedback",
        strength: float = 1.0,
        clip: float | None = None,
    ) -> None:
        if rule not in RULES:
            raise ValueError(f"rule={rule!r}: one of {RULES}")
        self.model, self.optimizers, self.schedulers = model, list(optimizers), list(schedulers)
        self.rule, self.clip = rule, clip
        self.params = [p for p in model.parameters() if p.requires_grad]
        delayed = rule == "2bw"
        self.correction = (
            ErrorFeedback.for_method(correction, self.params, strength) if correction and delayed else None
        )
        self.previous: list[torch.Tensor] | None = None  # W(t-1); None after a drain (the next gradient is fresh)

    def drain(self) -> None:
        """The pipeline empties (validation, the end): the next update's gradient is of the newest weights."""
        self.previous = None

    def step(self, loss_of: Callable[[torch.nn.Module], torch.Tensor]) -> float:
        # W(t), kept only where the rule reads another version: the step's base, the correction's and next W(t-1)
        now = [p.detach().clone() for p in self.params] if self.rule == "2bw" else None
        stale = self.rule == "2bw" and self.previous is not None
        if stale:
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in self.params], self.previous)  # read W(t-1)
        loss = loss_of(self.model)
        loss.backward()
        if stale:
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in self.params], now)  # the step is on W(t)
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if self.correction is not None:
            self.correction.apply(now, stale)
        for scheduler in self.schedulers:
            scheduler.step()
        self.previous = now
        return loss.item()


def compose(args: argparse.Namespace, seed: int):
    """The run's config as ``pd2bw-train`` composes it: ``recipe=tiny``, the model, the corpus and the overrides."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from benchmarks.convergence import CORPORA
    from benchmarks.convergence_settings import MODELS
    from lightning_pd2bw.cli.train import CONF, RECIPES, setup_hydra

    setup_hydra()
    overrides = [
        f"model={args.model}",
        f"trainer.max_steps={args.steps}",
        f"seed={seed}",
        f"model.config.seed={1234 + seed}",
        *([f"model.config.name={args.preset}"] if args.preset else []),
        f"data.seq_len={args.seq_len or MODELS.get(args.model, 128)}",
        *([] if args.corpus == "stdlib" else [f"data.paths=[{CORPORA[args.corpus](args.out)}]"]),
        *args.overrides,
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


def train(args: argparse.Namespace, rule: str, seed: int) -> dict:
    """One run of ``rule``: validation curve, training losses, seconds."""
    import lightning.pytorch as pl
    from hydra.utils import instantiate

    cfg = compose(args, seed)
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
    def validate() -> float:
        model.eval()
        losses = []
        for i, batch in enumerate(data.val_dataloader()):
            if i == args.val_batches:
                break
            losses.append(loss_of(on_device(batch))(model).item())
        model.train()
        loop.drain()
        return statistics.mean(losses)

    curve, train_losses, start = [], [], time.perf_counter()
    order = cfg.seed if args.data_seed is None else args.data_seed
    stream = batches(data.train_set, cfg.global_batch_size, order)
    for step in range(1, args.steps + 1):
        train_losses.append(loop.step(loss_of(on_device(next(stream)))))
        if step % args.val_every == 0 or step == args.steps:
            curve.append((step, validate()))
            print(f"  {rule} seed {seed} step {step}: val {curve[-1][1]:.4f}", flush=True)
    return {"curve": curve, "train": train_losses, "seconds": time.perf_counter() - start}


def run_label(args: argparse.Namespace, rule: str) -> str:
    """The name of ``rule``'s runs under these arguments. The synchronous rule reads no ``strategy.*`` key (the delay
    correction's), so one sync run serves every screen of those keys."""
    order = [] if args.data_seed is None else [f"order{args.data_seed}"]
    overrides = [o for o in args.overrides if rule != "sync" or not o.startswith("strategy.")]
    return "-".join([args.model, args.preset or "", args.corpus, str(args.steps), *order, *overrides]).replace("/", "_")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt_small", help="conf/model/NAME (its optimizer, rate, warm-up)")
    parser.add_argument("--preset", help="another GPTConfig preset for the model's shape (gpt2: GPT-2 124M-shaped)")
    parser.add_argument("--seq-len", type=int, help="data.seq_len (default: the convergence benchmark's)")
    parser.add_argument("--corpus", default="fortunes", help="stdlib, packages, copyrights or fortunes")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--val-every", type=int, default=250)
    parser.add_argument("--val-batches", type=int, default=16, help="as the convergence benchmark's limit_val_batches")
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--data-seed", type=int, help="the batch order's seed (default: the run's, as pd2bw-train)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "delayed_rule")
    parser.add_argument("--rules", default=",".join(RULES), help="the rules to run (finished ones are reused)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as pd2bw-train takes them")
    args = parser.parse_args()
    rules = args.rules.split(",")
    if unknown := set(rules) - set(RULES):
        parser.error(f"--rules: {sorted(unknown)} unknown; the rules are {RULES}")
    args.out.mkdir(parents=True, exist_ok=True)
    label = run_label(args, "2bw")
    results = {}
    for seed in range(args.seeds):
        for rule in RULES:
            path = args.out / f"{run_label(args, rule)}-{rule}-seed{seed}.json"
            if not path.exists() and rule in rules:
                path.write_text(json.dumps(train(args, rule, seed)))
            if path.exists():
                results[f"{rule}/seed{seed}"] = json.loads(path.read_text())
    if len(results) < len(RULES) * args.seeds:
        print(f"{label}: ran {sorted(results)}; the gap needs both rules (--rules {','.join(RULES)})")
        return
    gaps = []
    for seed in range(args.seeds):
        sync, late = (results[f"{rule}/seed{seed}"]["curve"][-1][1] for rule in RULES)
        gaps.append(100 * (late / sync - 1))
        seconds = " / ".join(f"{results[f'{rule}/seed{seed}']['seconds']:.0f} s" for rule in RULES)
        print(f"seed {seed}: sync {sync:.4f}, 2bw {late:.4f}, 2BW vs sync {gaps[-1]:+.2f}% ({seconds})")
    print(f"{label}: 2BW vs sync, mean {statistics.mean(gaps):+.2f}% over {args.seeds} seed(s)")
    (args.out / "delayed_rule.json").write_text(json.dumps({"label": label, "runs": results, "gaps": gaps}))


if __name__ == "__main__":
    main()
