"""How large a step each update rule survives: the stability bound of a one-step delay with momentum (issue 64).

    python benchmarks/delay_stability.py                      # sync, 2BW and its corrections at beta1 0.85-0.95
    python benchmarks/delay_stability.py --betas 0.9 --strengths 0.5,0.75,1,1.5

On a quadratic ``f(w) = h w^2 / 2`` with momentum ``m = beta1 m + (1 - beta1) g`` (Adam's first moment; Adam's
second moment is a fixed preconditioner there, folded into ``h``), an update rule is stable for ``lr * h`` below a
threshold. Adam's training sits at that threshold in the sharpest directions (the edge of stability, Cohen et al.,
arXiv 2207.14484), so a rule with a lower one is held to flatter, slower ground at the same learning rate. The
synchronous rule's threshold is ``2 (1 + beta1) / (1 - beta1)`` (38 at 0.9); a one-step-stale gradient's is 1 at any
beta1 (the roots of ``(z - 1)(z - beta1) + lr h (1 - beta1)`` leave the unit circle at ``lr h = 1``). The thresholds are
measured here by running the product's rule (``benchmarks/delayed_rule.DelayedRule``: the engine's ``ErrorFeedback``
on a stale gradient) on that quadratic in float64 and bisecting ``lr h`` for the step where the iterates stop
shrinking; ``tests/unit/test_delay_stability.py`` checks them against the closed forms above and against the
eigenvalues of each correction's linear map written out by hand.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: benchmarks.* importable

from benchmarks.delayed_rule import DelayedRule  # noqa: E402

SETTINGS = {  # label -> (rule, delay_correction)
    "sync": ("sync", None),
    "2bw": ("2bw", None),
    "2bw+ef": ("2bw", "error_feedback"),
    "2bw+pef": ("2bw", "predictive_error_feedback"),
}


def grows(step: float, beta1: float, rule: str, correction: str | None, strength: float, steps: int) -> bool:
    """Whether ``rule`` with momentum ``beta1`` and step ``lr * h = step`` grows on ``f(w) = w^2 / 2``: the largest
    |w| of the last quarter of ``steps`` above that of the second quarter (a contraction shrinks it by orders)."""
    weight = torch.nn.Parameter(torch.ones((), dtype=torch.float64))
    model = torch.nn.ParameterList([weight])
    # SGD with dampening = momentum keeps Adam's first moment, m = beta1 m + (1 - beta1) g
    optimizer = torch.optim.SGD([weight], lr=step, momentum=beta1, dampening=beta1)
    loop = DelayedRule(model, [optimizer], rule=rule, correction=correction, strength=strength)
    history = []
    for _ in range(steps):
        loop.step(lambda m: 0.5 * m[0] ** 2)
        history.append(abs(weight.item()))
        if not history[-1] < 1e12:  # overflow or NaN: unstable
            return True
    quarter = steps // 4
    return max(history[-quarter:]) > max(history[quarter : 2 * quarter])


def threshold(
    beta1: float,
    rule: str,
    correction: str | None = None,
    strength: float = 1.0,
    steps: int = 2000,
    tolerance: float = 5e-3,
) -> float:
    """The largest stable ``lr * h`` below 200, bisected to ``tolerance`` (relative)."""
    low, high = 0.0, 200.0
    while high - low > tolerance * high:
        middle = (low + high) / 2
        if grows(middle, beta1, rule, correction, strength, steps):
            high = middle
        else:
            low = middle
    return low


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--betas", default="0.85,0.9,0.95", help="beta1 values (Adam's; Muon's momentum is 0.95)")
    parser.add_argument("--strengths", default="1", help="delay_correction_strength values for the corrections")
    args = parser.parse_args()
    betas = [float(b) for b in args.betas.split(",")]
    strengths = [float(s) for s in args.strengths.split(",")]
    rows = [(label, rule, correction, 1.0) for label, (rule, correction) in SETTINGS.items() if correction is None]
    rows += [
        (f"{label} s={s:g}", rule, correction, s)
        for label, (rule, correction) in SETTINGS.items()
        if correction is not None
        for s in strengths
    ]
    print("largest stable lr * h (sharpness); Adam's training sits at it in its sharpest directions")
    print(f"{'rule':<20}" + "".join(f"beta1={b:<8g}" for b in betas))
    for label, rule, correction, strength in rows:
        print(f"{label:<20}" + "".join(f"{threshold(b, rule, correction, strength):<14.2f}" for b in betas))


if __name__ == "__main__":
    main()
