"""Lag or instability? The preconditioned sharpness of the synchronous run against the rules' stability bounds
(issue 76, the diagnostic before any optimizer-side lever).

    python benchmarks/sharpness.py --model gpt_small --steps 1000 --at 100,250,500      # AdamW, the one-process rule
    python benchmarks/sharpness.py --model gpt_tiny --steps 2000 --at 100,250,500,1000 model.lr=8e-3

``benchmarks/delay_stability.py`` gives each rule's largest stable ``lr * h`` on a quadratic with Adam's momentum,
Adam's second moment folded into ``h``: 38 for the synchronous rule at beta1 0.9, 1 for a stale gradient, 3.31 with
2BW's default predictive correction. Whether that bound is what holds 2BW back depends on where training sits: this
measures, at the given steps of the synchronous run (Flush's rule, ``delayed_rule.DelayedRule``), the largest
eigenvalue of ``P^-1 H`` (``H``: the Hessian of the step's batch loss; ``P``: Adam's diagonal ``sqrt(v_hat) + eps``, as
Cohen et al., arXiv 2207.14484, measure the edge of stability of adaptive methods) by power iteration on
``P^-1/2 H P^-1/2`` with Hessian-vector products, and prints ``lr * lambda`` beside the bounds. Above 3.31: the
default 2BW could not follow the synchronous run there (instability); far below it: the gap is the delay's lag.
``--rule 2bw`` measures 2BW's own run (at W(t+1) after each update): where the bound is the mechanism, 2BW sits at
its own, flatter edge (near 3.31) while the synchronous run sits near its.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: benchmarks.* importable

from benchmarks.delayed_rule import DelayedRule, train  # noqa: E402


def adam_diagonal(params: Sequence[torch.nn.Parameter], optimizers: Sequence[torch.optim.Optimizer]) -> list:
    """Adam's preconditioner per parameter, ``sqrt(v_hat) + eps`` as its step divides by (None: not Adam's)."""
    diagonal: dict[int, torch.Tensor] = {}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            beta2, eps = group["betas"][1], group["eps"]
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                if "exp_avg_sq" in state:
                    step = float(state["step"])
                    diagonal[id(p)] = (state["exp_avg_sq"] / (1 - beta2**step)).sqrt() + eps
    return [diagonal.get(id(p)) for p in params]


def preconditioned_sharpness(
    model: torch.nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    loss_of: Callable[[torch.nn.Module], torch.Tensor],
    iterations: int = 20,
    seed: int = 0,
) -> float:
    """The largest eigenvalue of ``P^-1 H`` at the model's weights on one batch (power iteration; the parameters
    Adam does not step left out)."""
    params = [p for p in model.parameters() if p.requires_grad]
    pairs = [(p, d) for p, d in zip(params, adam_diagonal(params, optimizers)) if d is not None]
    params, scales = [p for p, _ in pairs], [d.rsqrt() for _, d in pairs]  # P^-1/2
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):  # the fused attention kernels have no second derivative
        grads = torch.autograd.grad(loss_of(model), params, create_graph=True)
    generator = torch.Generator().manual_seed(seed)
    v = [torch.randn(p.shape, generator=generator, dtype=p.dtype).to(p.device) for p in params]
    eigenvalue = 0.0
    for _ in range(iterations):
        norm = math.sqrt(sum(float((x * x).sum()) for x in v))
        v = [x / norm for x in v]
        hv = torch.autograd.grad(grads, params, [x * s for x, s in zip(v, scales)], retain_graph=True)
        w = [h * s for h, s in zip(hv, scales)]  # P^-1/2 H P^-1/2 v
        eigenvalue = sum(float((a * b).sum()) for a, b in zip(w, v))  # its Rayleigh quotient
        v = [x.detach() for x in w]
    model.zero_grad(set_to_none=True)
    return eigenvalue


def bounds(beta1: float) -> dict[str, float]:
    """The rules' largest stable ``lr * h`` at ``beta1`` (``delay_stability.threshold``)."""
    from benchmarks.delay_stability import threshold

    return {
        "sync": threshold(beta1, "sync"),
        "2BW default (predictive)": threshold(beta1, "2bw", "predictive_error_feedback"),
        "2BW plain": threshold(beta1, "2bw"),
    }


def main() -> None:

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt_small")
    parser.add_argument("--corpus", default="fortunes")
    parser.add_argument("--steps", type=int, default=1000, help="the run's length (its schedules)")
    parser.add_argument("--at", default="100,250,500", help="the steps measured at")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument(
        "--rule",
        default="sync",
        choices=("sync", "2bw"),
        help="whose run: 2BW's sits at its own edge if the bound holds",
    )
    parser.add_argument("--sync-steps", type=int, default=0, help="with --rule 2bw: its synchronous start's length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "delayed_rule")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as pd2bw-train takes them")
    cli = parser.parse_args()
    at = sorted(int(s) for s in cli.at.split(","))
    args = argparse.Namespace(
        model=cli.model, preset=None, seq_len=None, corpus=cli.corpus, steps=cli.steps, val_every=cli.steps,
        val_batches=16, seeds=1, data_seed=None, device="cpu", out=cli.out, sync_steps=cli.sync_steps,
        overrides=cli.overrides,
    )  # fmt: skip
    cli.out.mkdir(parents=True, exist_ok=True)
    found: list[tuple[int, float, float]] = []

    def probe(step: int, loop: DelayedRule, loss_of: Callable) -> None:
        if step in at:
            sharpness = preconditioned_sharpness(loop.model, loop.optimizers, loss_of, cli.iterations, cli.seed)
            lr = loop.optimizers[0].param_groups[0]["lr"]
            found.append((step, lr, sharpness))
            print(f"  step {step}: lr {lr:.2e}, lambda_max(P^-1 H) {sharpness:.4g}, lr * lambda {lr * sharpness:.3g}")
        if step == at[-1]:
            raise StopIteration  # the rest of the run is not needed

    try:
        train(args, cli.rule, cli.seed, cli.steps, probe)
    except StopIteration:
        pass
    beta1 = 0.9  # the models' AdamW (conf/model: betas [0.9, 0.95])
    limits = bounds(beta1)
    print(f"\nthe {cli.rule} run's lr * lambda_max(P^-1 H) against each rule's largest stable lr * h (beta1 {beta1}):")
    print("| step | lr | lambda_max(P^-1 H) | lr * lambda | " + " | ".join(limits) + " |")
    print("|---" * (4 + len(limits)) + "|")
    for step, lr, sharpness in found:
        ratios = " | ".join(f"{lr * sharpness / limit:.2f} of it" for limit in limits.values())
        print(f"| {step} | {lr:.2e} | {sharpness:.4g} | {lr * sharpness:.3g} | {ratios} |")
    print("bounds: " + ", ".join(f"{name} {limit:.2f}" for name, limit in limits.items()))


if __name__ == "__main__":
    main()
