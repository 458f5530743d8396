"""``benchmarks/delayed_rule.py``'s loop against delayed SGD computed by hand (float64): the one-process 2BW rule
that issue 64's large-model measurement runs must be the pipeline's rule (stale gradient, predictive correction,
drains restarting it), not an approximation of it."""

from argparse import Namespace

import pytest
import torch

from benchmarks.delayed_rule import DelayedRule, run_label

TARGETS = torch.tensor([[1.0, -2.0], [0.5, 3.0], [-1.0, 0.0], [2.0, 1.0], [0.0, -1.0], [1.5, 0.5]], dtype=torch.float64)
LR, DRAIN_AFTER = 0.3, 3  # a drain (validation) after the third update


def by_hand(rule: str, correction: str | None) -> torch.Tensor:
    """f_t(w) = |w - a_t|^2 / 2, SGD at LR. 2BW reads W(t-1) (W(t) on the first update and after a drain); the
    predictive correction in its nested form: E(t) = D(t) + (D(t) - D(t-1)), the weights move by
    E(t) + (E(t) - E(t-1)); error feedback by E(t); a fresh update moves by D(t) and restarts both histories."""
    w = torch.zeros(2, dtype=torch.float64)
    previous_w, previous_d, previous_e = None, None, None
    for t, target in enumerate(TARGETS):
        read = previous_w if rule == "2bw" and previous_w is not None else w
        d = -LR * (read - target)
        stale = rule == "2bw" and previous_w is not None
        if stale and correction is not None:
            e = d + (d - previous_d)
            move = e + (e - previous_e) if correction == "predictive_error_feedback" else e
        else:
            e, move = d, d
        previous_w, previous_d, previous_e = w, d, e
        w = w + move
        if t + 1 == DRAIN_AFTER:
            previous_w = None
    return w


@pytest.mark.parametrize(
    "rule, correction",
    [("sync", None), ("2bw", None), ("2bw", "error_feedback"), ("2bw", "predictive_error_feedback")],
)
def test_the_one_process_rule_is_delayed_sgd_by_hand(rule, correction):
    model = torch.nn.Linear(1, 2, bias=False).double()  # its weight: the vector w
    with torch.no_grad():
        model.weight.zero_()
    loop = DelayedRule(model, [torch.optim.SGD(model.parameters(), lr=LR)], rule=rule, correction=correction)
    for t, target in enumerate(TARGETS):
        loop.step(lambda m, a=target: 0.5 * ((m.weight[:, 0] - a) ** 2).sum())
        if t + 1 == DRAIN_AFTER:
            loop.drain()
    torch.testing.assert_close(model.weight[:, 0].detach(), by_hand(rule, correction), rtol=0, atol=1e-12)


def test_the_rules_differ_so_the_test_can_fail():
    rules = [("sync", None), ("2bw", None), ("2bw", "error_feedback"), ("2bw", "predictive_error_feedback")]
    finals = [by_hand(*r) for r in rules]
    assert all((a - b).abs().max() > 1e-3 for i, a in enumerate(finals) for b in finals[i + 1 :])


def test_one_sync_run_serves_the_screens_of_the_correction():
    """``strategy.*`` keys configure only 2BW's correction: the sync rule's runs are shared across them; any other
    override (the optimizer's betas) names its own sync run."""

    def args(*overrides: str) -> Namespace:
        return Namespace(
            model="gpt_small", preset=None, corpus="fortunes", steps=1000, data_seed=None, overrides=overrides
        )

    screen = args("strategy.delay_correction_strength=0.75")
    assert run_label(screen, "sync") == run_label(args(), "sync")
    assert run_label(screen, "2bw") != run_label(args(), "2bw")
    betas = args("model.betas=[0.95,0.95]")
    assert run_label(betas, "sync") != run_label(args(), "sync")
    assert "/" not in run_label(args("data.paths=[/tmp/x]"), "sync")
