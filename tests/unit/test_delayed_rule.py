"""``benchmarks/delayed_rule.py``'s loop against delayed SGD computed by hand (float64): the one-process 2BW rule
that issue 64's large-model measurement runs must be the pipeline's rule (stale gradient, predictive correction,
drains restarting it), not an approximation of it."""

from argparse import Namespace

import pytest
import torch

from benchmarks.delayed_rule import DelayedRule, rule_overrides, run_label
from benchmarks.time_to_quality import time_to_quality

TARGETS = torch.tensor([[1.0, -2.0], [0.5, 3.0], [-1.0, 0.0], [2.0, 1.0], [0.0, -1.0], [1.5, 0.5]], dtype=torch.float64)
LR, DRAIN_AFTER = 0.3, 3  # a drain (validation) after the third update


def by_hand(rule: str, correction: str | None, sync_steps: int = 0) -> torch.Tensor:
    """f_t(w) = |w - a_t|^2 / 2, SGD at LR. 2BW reads W(t-1) (W(t) on the first update and after a drain); the
    predictive correction in its nested form: E(t) = D(t) + (D(t) - D(t-1)), the weights move by
    E(t) + (E(t) - E(t-1)); error feedback by E(t); a fresh update moves by D(t) and restarts both histories.
    ``sync_steps`` K: updates 0..K are fresh (K synchronous ones, then 2BW from a drain)."""
    w = torch.zeros(2, dtype=torch.float64)
    previous_w, previous_d, previous_e = None, None, None
    for t, target in enumerate(TARGETS):
        stale = rule == "2bw" and previous_w is not None and t > sync_steps
        read = previous_w if stale else w
        d = -LR * (read - target)
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


@pytest.mark.parametrize("sync_steps", [1, 4])
@pytest.mark.parametrize("correction", [None, "predictive_error_feedback"])
def test_a_synchronous_start_is_fresh_for_k_updates_then_the_delayed_rule(sync_steps, correction):
    model = torch.nn.Linear(1, 2, bias=False).double()
    with torch.no_grad():
        model.weight.zero_()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    loop = DelayedRule(model, [optimizer], rule="2bw", correction=correction, sync_steps=sync_steps)
    for t, target in enumerate(TARGETS):
        loop.step(lambda m, a=target: 0.5 * ((m.weight[:, 0] - a) ** 2).sum())
        if t + 1 == DRAIN_AFTER:
            loop.drain()
    expected = by_hand("2bw", correction, sync_steps)
    torch.testing.assert_close(model.weight[:, 0].detach(), expected, rtol=0, atol=1e-12)
    assert (expected - by_hand("2bw", correction)).abs().max() > 1e-3  # the start changes the result
    assert (expected - by_hand("sync", None)).abs().max() > 1e-3  # and it is not the synchronous rule


def test_rule_prefixed_overrides_reach_one_rule_only():
    overrides = ["sync:model.lr=2e-3", "2bw:model.lr=1e-3", "model.betas=[0.9,0.95]"]
    assert rule_overrides(overrides, "sync") == ["model.lr=2e-3", "model.betas=[0.9,0.95]"]
    assert rule_overrides(overrides, "2bw") == ["model.lr=1e-3", "model.betas=[0.9,0.95]"]
    assert rule_overrides(["data.paths=[c:/x]"], "sync") == ["data.paths=[c:/x]"]  # not a rule's prefix


def test_the_rules_differ_so_the_test_can_fail():
    rules = [("sync", None), ("2bw", None), ("2bw", "error_feedback"), ("2bw", "predictive_error_feedback")]
    finals = [by_hand(*r) for r in rules]
    assert all((a - b).abs().max() > 1e-3 for i, a in enumerate(finals) for b in finals[i + 1 :])


def run_args(*overrides: str, sync_steps: int = 0) -> Namespace:
    """``delayed_rule.py``'s arguments, as ``run_label`` reads them."""
    return Namespace(
        model="gpt_small", preset=None, corpus="fortunes", steps=1000, data_seed=None, sync_steps=sync_steps,
        overrides=list(overrides),
    )  # fmt: skip


def test_one_sync_run_serves_the_screens_of_the_correction():
    """``strategy.*`` keys configure only 2BW's correction: the sync rule's runs are shared across them; any other
    override (the optimizer's betas) names its own sync run."""
    args = run_args
    screen = args("strategy.delay_correction_strength=0.75")
    assert run_label(screen, "sync") == run_label(args(), "sync")
    assert run_label(screen, "2bw") != run_label(args(), "2bw")
    betas = args("model.betas=[0.95,0.95]")
    assert run_label(betas, "sync") != run_label(args(), "sync")
    assert "/" not in run_label(args("data.paths=[/tmp/x]"), "sync")


def test_a_synchronous_start_names_its_2bw_runs_and_shares_the_sync_run():
    def args(sync_steps: int) -> Namespace:
        return run_args("sync:model.lr=1e-3", sync_steps=sync_steps)

    assert run_label(args(250), "sync") == run_label(args(0), "sync")
    assert run_label(args(250), "2bw") != run_label(args(0), "2bw")
    assert "model.lr=1e-3" in run_label(args(0), "sync") and "model.lr" not in run_label(args(0), "2bw")
    assert run_label(args(0), "2bw", 1250) != run_label(args(0), "2bw")  # a horizon is its own run


def test_time_to_quality_interpolates_the_horizons_and_divides_by_the_rate():
    """Sync ends at 2.0 after 1,000 steps; 2BW at 2.1 after 1,000 and 1.9 after 1,200: 2BW reaches 2.0 at 1,100 steps
    (1.1x), and at 1.25x Flush's rate in 1.1 / 1.25 = 0.88 of Flush's time."""
    args = Namespace(steps=1000, seeds=1, sync_steps=0)
    results = {
        "sync@1000/seed0": {"curve": [[1000, 2.0]]},
        "2bw@1000/seed0": {"curve": [[1000, 2.1]]},
        "2bw@1200/seed0": {"curve": [[1200, 1.9]]},
    }
    table, overheads = time_to_quality(results, args, [1000, 1200], {"planned": 1.25})
    assert overheads == [pytest.approx(1.1)]
    seed_row = next(line for line in table.splitlines() if line.startswith("| 0 |"))
    assert "| 1.100x | 0.880 |" in seed_row
    results["2bw@1200/seed0"]["curve"] = [[1200, 2.05]]  # never reaches 2.0
    table, overheads = time_to_quality(results, args, [1000, 1200], {"planned": 1.25})
    assert "not reached" in table and overheads == [None]
