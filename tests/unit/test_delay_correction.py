"""The delay corrections' rules (error feedback, predictive error feedback), by hand, and their bad inputs."""

from __future__ import annotations

import pytest
import torch

from lightning_pd2bw import PipeDream2BWStrategy
from lightning_pd2bw.engine.updates.delay_correction import ErrorFeedback


def test_rule_by_hand():
    """SGD (lr 1) on fixed gradients g1, g2: D(t) = -g(t); W(2) = W(1) + D(2) + beta (D(2) - D(1))."""
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    correction = ErrorFeedback([w], beta=0.5)
    before = w.detach().clone()
    with torch.no_grad():
        w -= torch.tensor([0.1, 0.2])  # D(1) = -(0.1, 0.2), fresh gradient: no correction
    correction.apply([before], stale=False)
    torch.testing.assert_close(w.detach(), torch.tensor([0.9, 1.8]))
    before = w.detach().clone()
    with torch.no_grad():
        w -= torch.tensor([0.3, 0.0])  # D(2) = -(0.3, 0)
    correction.apply([before], stale=True)
    # 0.9 - 0.3 + 0.5 * (-0.3 + 0.1) = 0.5;  1.8 + 0 + 0.5 * (0 + 0.2) = 1.9
    torch.testing.assert_close(w.detach(), torch.tensor([0.5, 1.9]))
    assert correction.held_bytes == 2 * 4  # one buffer of the weights: D(t-1)


def test_first_stale_update_without_history_is_plain():
    w = torch.nn.Parameter(torch.ones(3))
    correction = ErrorFeedback([w])
    before = w.detach().clone()
    with torch.no_grad():
        w.mul_(2)
    correction.apply([before], stale=True)  # no D(t-1) yet: nothing to feed back
    torch.testing.assert_close(w.detach(), torch.full((3,), 2.0))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"delay_correction": "nesterov"},
            r"\(delay_correction='nesterov'\) is invalid; valid: None, 'error_feedback', 'predictive_error_feedback'",
        ),
        (
            {"delay_correction": "error_feedback", "delay_correction_strength": 0},
            r"\(delay_correction_strength=0\) must be > 0",
        ),
    ],
)
def test_bad_options_name_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PipeDream2BWStrategy(**kwargs)


def test_parameters_updated_apart_keep_their_own_history():
    """2BW defers the tied parameters' update: each parameter's correction uses its own last update,
    whichever call applied it (by hand, beta = 2: W(2) = W(1) + D(2) + 2 (D(2) - D(1)))."""
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    correction = ErrorFeedback([a, b], beta=2.0)
    updates = [(torch.tensor([0.1, -0.2]), torch.tensor([0.3, 0.0, -0.1])), (torch.tensor([0.4, 0.1]), torch.ones(3))]
    for t, (da, db) in enumerate(updates):
        before = a.detach().clone()
        with torch.no_grad():
            a += da
        correction.apply([before], stale=t >= 1, parameters=[a])  # the main update: a only
        before = b.detach().clone()
        with torch.no_grad():
            b += db
        correction.apply([before], stale=t >= 1, parameters=[b])  # the deferred one: b
    torch.testing.assert_close(a.detach(), torch.tensor([0.5, -0.1]) + 2 * torch.tensor([0.3, 0.3]))
    torch.testing.assert_close(b.detach(), torch.tensor([1.3, 1.0, 0.9]) + 2 * torch.tensor([0.7, 1.0, 1.1]))
    assert correction.held_bytes == 5 * 4


def test_predictive_rule_by_hand():
    """beta = 1: the second update after a fresh one moves by 4 D(2) - 3 D(1), later ones by
    4 D(t) - 4 D(t-1) + D(t-2); two buffers held (D(t-1), D(t-2))."""
    w = torch.nn.Parameter(torch.zeros(2))
    correction = ErrorFeedback.for_method("predictive_error_feedback", [w])
    updates = [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), torch.tensor([2.0, 2.0])]
    # step 1 (fresh): (1, 0); step 2: (1, 0) + 4 (0, 1) - 3 (1, 0) = (-2, 4);
    # step 3: (-2, 4) + 4 (2, 2) - 4 (0, 1) + (1, 0) = (7, 8)
    expected = [torch.tensor([1.0, 0.0]), torch.tensor([-2.0, 4.0]), torch.tensor([7.0, 8.0])]
    for t, (update, want) in enumerate(zip(updates, expected)):
        before = w.detach().clone()
        with torch.no_grad():
            w += update
        correction.apply([before], stale=t >= 1)
        torch.testing.assert_close(w.detach(), want)
    assert correction.held_bytes == 2 * 2 * 4


def test_predictive_is_error_feedback_applied_to_the_corrected_updates():
    """Against the nested form, E(t) = D(t) + beta (D(t) - D(t-1)) and the weights moving by
    E(t) + beta (E(t) - E(t-1)), over random updates with a fresh one (a drain) in the middle."""
    torch.manual_seed(0)
    beta = 0.5
    w = torch.nn.Parameter(torch.randn(5))
    reference = w.detach().clone()
    correction = ErrorFeedback([w], beta=beta, order=2)
    fresh = {0, 4}
    previous = previous_corrected = None
    for t in range(8):
        update = torch.randn(5)
        before = w.detach().clone()
        with torch.no_grad():
            w += update
        correction.apply([before], stale=t not in fresh)
        if t in fresh:
            corrected = update
        else:
            first = update + beta * (update - previous)
            corrected = first + beta * (first - previous_corrected)
        previous, previous_corrected = update, (update if t in fresh else first)
        reference += corrected
        torch.testing.assert_close(w.detach(), reference)


@pytest.mark.parametrize("order", [1, 2])
def test_a_restarted_entry_forgets_its_history_and_counts_from_its_new_value(order):
    """Issue 65: a weight dropped (zeroed) and grown again within two updates restarts from zero. By hand, in
    float64, beta = 1: entry 0 keeps its history; entry 1 was zeroed from outside before this update (a mask
    change), so its D(t) counts from 0 and D(t-1), D(t-2) are 0 there."""
    weight = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    correction = ErrorFeedback([weight], beta=1.0, order=order)
    history = [torch.tensor([0.5, 0.7], dtype=torch.float64), torch.tensor([0.3, 0.9], dtype=torch.float64)]
    value = torch.zeros(2, dtype=torch.float64)
    for step, delta in enumerate(history):  # two stale updates: D(t-2), D(t-1) recorded
        before = value.clone()
        weight.data = before + delta
        correction.apply([before], stale=step >= 1)
        value = weight.data.clone()
    weight.data[1] = 0.0  # the mask change: dropped, then grown again at zero
    correction.restart(weight, torch.tensor([False, True]))
    before = value.clone()  # W(t) as the version holds it: entry 1 still at its old value
    step = torch.tensor([0.2, 0.1], dtype=torch.float64)
    weight.data = weight.data + step  # the optimizer's step from the restarted value
    correction.apply([before], stale=True)
    d_prev, d_prev2 = history[1], history[0]
    if order == 1:  # W += D(t) + (D(t) - D(t-1))
        expected0 = value[0] + step[0] + (step[0] - d_prev[0])
        expected1 = 0.0 + step[1] + step[1]  # no history: D(t-1) = 0
    else:  # W += 4 D(t) - 4 D(t-1) + D(t-2)
        expected0 = value[0] + 4 * step[0] - 4 * d_prev[0] + d_prev2[0]
        expected1 = 0.0 + 4 * step[1]
    torch.testing.assert_close(
        weight.data, torch.stack([torch.as_tensor(expected0), torch.as_tensor(expected1, dtype=torch.float64)])
    )
    assert correction.previous[id(weight)][1] == step[1], "D(t) there counts from the restarted value"


def test_a_replica_that_owns_nothing_applies_nothing():
    """The sharded optimizer at a width above a stage's tensor count (the tiny GPT's embedding stage at 4 x 4, found by
    the 16-process run of issue 95): a replica owns no tensor, and its correction's update is a no-op, not a
    ``_foreach`` call on an empty list."""
    for method in ("error_feedback", "predictive_error_feedback"):
        correction = ErrorFeedback.for_method(method, [])
        correction.apply([], stale=True)
        correction.apply([], stale=True, scratch=True)
        assert correction.held_bytes == 0
