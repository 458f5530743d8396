"""Sparsity schedules and allocation: formulas at their endpoints and midpoints, hand-computed."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_pd2bw.sparsity import schedules
from lightning_pd2bw.sparsity.allocation import erk_densities, global_threshold, keep_count


def test_cubic_schedule_endpoints_and_midpoint():
    kwargs = dict(start_step=10, end_step=30, interval=1, final_density=0.2)
    assert schedules.gradual_density(0, **kwargs) == 1.0  # before the start: dense
    assert schedules.gradual_density(10, **kwargs) == pytest.approx(1.0)
    # midpoint: s = s_f + (s_i - s_f)(1 - 1/2)^3 = 0.8 - 0.8/8 = 0.7 -> density 0.3
    assert schedules.gradual_density(20, **kwargs) == pytest.approx(0.3)
    assert schedules.gradual_density(30, **kwargs) == pytest.approx(0.2)
    assert schedules.gradual_density(99, **kwargs) == pytest.approx(0.2)


def test_linear_schedule_and_initial_sparsity():
    kwargs = dict(start_step=0, end_step=100, interval=1, final_density=0.25, initial_density=0.75, shape="linear")
    assert schedules.gradual_density(0, **kwargs) == pytest.approx(0.75)
    assert schedules.gradual_density(50, **kwargs) == pytest.approx(0.5)
    assert schedules.gradual_density(100, **kwargs) == pytest.approx(0.25)


def test_schedule_holds_between_update_steps():
    kwargs = dict(start_step=0, end_step=100, interval=10, final_density=0.1)
    assert schedules.gradual_density(15, **kwargs) == schedules.gradual_density(10, **kwargs)
    assert schedules.gradual_density(19, **kwargs) != schedules.gradual_density(20, **kwargs)
    updates = [s for s in range(120) if schedules.is_update_step(s, 0, 95, 10)]
    assert updates == [0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 95]


def test_rigl_cosine_drop_fraction():
    assert schedules.rigl_drop_fraction(0, 100, 0.3) == pytest.approx(0.3)
    assert schedules.rigl_drop_fraction(50, 100, 0.3) == pytest.approx(0.15)
    assert schedules.rigl_drop_fraction(25, 100, 0.3) == pytest.approx(0.15 * (1 + math.cos(math.pi / 4)))
    assert schedules.rigl_drop_fraction(100, 100, 0.3) == 0.0


def test_rewarmup_factor():
    assert schedules.rewarmup_factor(4, 5, 4) == 1.0
    assert schedules.rewarmup_factor(5, 5, 4) == pytest.approx(0.25)
    assert schedules.rewarmup_factor(7, 5, 4) == pytest.approx(0.75)
    assert schedules.rewarmup_factor(8, 5, 4) == 1.0
    assert schedules.rewarmup_factor(5, 5, 0) == 1.0


def test_restart_lr_is_a_cosine_from_its_peak_to_a_tenth():
    assert schedules.restart_lr(10, 10, 20, 2.0) == pytest.approx(2.0)
    assert schedules.restart_lr(15, 10, 20, 2.0) == pytest.approx(2.0 * (0.1 + 0.9 * 0.5))
    assert schedules.restart_lr(20, 10, 20, 2.0) == pytest.approx(0.2)
    assert schedules.restart_lr(25, 10, 20, 2.0) == pytest.approx(0.2)


def test_learning_rate_rewarms_after_every_mask_change():
    """Hand-computed: pruning updates at 4, 7, 10 (window 4-10, every 3) and SPDF's switch at 14, W = 2; the masks of
    step 0 precede training and get no re-warm-up."""
    from lightning_pd2bw.sparsity import GradualMagnitudeSparsity, RigL, StaticSparsity

    gradual = GradualMagnitudeSparsity(0.5, start_step=4, end_step=10, update_interval=3, rewarmup_steps=2)
    gradual.dense_from_step = 14
    factors = [gradual.lr_factor(k) for k in range(17)]
    expected = [1, 1, 1, 1, 0.5, 1, 1, 0.5, 1, 1, 0.5, 1, 1, 1, 0.5, 1, 1]
    assert factors == pytest.approx(expected)
    rigl = RigL(0.5, end_step=9, update_interval=4, rewarmup_steps=3)  # drop-and-grow at 4 and 8
    assert [rigl.lr_factor(k) for k in range(12)] == pytest.approx([1, 1, 1, 1, 1 / 3, 2 / 3, 1, 1, 1 / 3, 2 / 3, 1, 1])
    assert [StaticSparsity(0.5, rewarmup_steps=4).lr_factor(k) for k in range(3)] == [1, 1, 1]
    assert GradualMagnitudeSparsity(0.5, start_step=4, end_step=10, update_interval=3).lr_factor(4) == 1.0


def test_erk_meets_the_overall_density_and_favours_small_layers():
    shapes = {"small": (16, 16), "wide": (64, 256), "big": (256, 256)}
    numels = {n: math.prod(s) for n, s in shapes.items()}
    densities = erk_densities(shapes, 0.2)
    overall = sum(densities[n] * numels[n] for n in shapes) / sum(numels.values())
    assert overall == pytest.approx(0.2)
    # proportional to (sum of dims) / (prod of dims) where not clipped
    ratio = densities["big"] / densities["wide"]
    assert ratio == pytest.approx((512 / 256**2) / (320 / (64 * 256)))
    assert densities["small"] == 1.0, "a layer ERK would give more than 1 is dense and the rest rescaled"


def test_global_threshold_is_the_kth_largest_value_over_all_parts():
    generator = torch.Generator().manual_seed(0)
    parts = [torch.rand(n, generator=generator) for n in (7, 100, 33)]
    values = torch.cat(parts).sort(descending=True).values
    for keep in (1, 10, 70, 140):
        threshold = global_threshold(parts, keep)
        assert threshold == values[keep - 1].item()
        assert sum(int((p >= threshold).sum()) for p in parts) == keep


def test_keep_count_never_empties_a_layer():
    assert keep_count(100, 0.0) == 1
    assert keep_count(100, 0.255) == 26
    assert keep_count(10, 1.0) == 10


def test_n_of_m_thins_from_m_to_n_over_the_window():
    # 2:4 over steps 10-30: 4 kept before the window, 3 in its first half, 2 from its middle on and after it
    kept = {step: schedules.n_of_m_at(step, 10, 30, 2, 4) for step in (0, 9, 10, 19, 20, 29, 30, 100)}
    assert kept == {0: 4, 9: 4, 10: 3, 19: 3, 20: 2, 29: 2, 30: 2, 100: 2}
    assert schedules.n_of_m_at(5, 5, 5, 1, 8) == 1  # a one-shot window
    assert [schedules.n_of_m_at(s, 0, 70, 1, 8) for s in range(0, 80, 10)] == [7, 6, 5, 4, 3, 2, 1, 1]


def test_n_of_m_masks_keep_the_n_largest_of_each_group_of_m_along_the_input_features():
    from lightning_pd2bw.sparsity import MaskUpdate, Sparsifier

    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(6, 16))
    sparsifier = Sparsifier({"w": weight})
    sparsifier.update(1, MaskUpdate("n_of_m", density=0.5, n=2, m=4))
    mask = sparsifier.masks["w"].reshape(6, 4, 4)  # rows x groups x 4 consecutive input features
    assert mask.sum(-1).eq(2).all()  # exactly 2 of each 4
    magnitudes = weight.detach().abs().reshape(6, 4, 4)
    kept_smallest = magnitudes.masked_fill(~mask, math.inf).amin(-1)
    dropped_largest = magnitudes.masked_fill(mask, -math.inf).amax(-1)
    assert (kept_smallest >= dropped_largest).all()  # by magnitude, group by group
    assert weight.detach().reshape(6, 4, 4).masked_select(~mask).eq(0).all()  # the pruned ones are zero
    assert sparsifier.layer_targets == {"w": 0.5}


def test_n_of_m_refuses_a_target_it_cannot_group_by_name():
    from lightning_pd2bw.sparsity import SemiStructuredSparsity, Sparsifier

    sparsifier = Sparsifier({"blocks.0.mlp.fc.weight": torch.nn.Parameter(torch.zeros(8, 6))})
    with pytest.raises(ValueError, match=r"blocks.0.mlp.fc.weight \[8, 6\] cannot be grouped by 4.*sparsity.exclude"):
        sparsifier.check_groups(4)
    with pytest.raises(ValueError, match="need 0 < n < m"):
        SemiStructuredSparsity(n=4, m=4)
    with pytest.raises(ValueError, match="allocation='global' does not apply"):
        SemiStructuredSparsity(allocation="global")
    with pytest.raises(ValueError, match=r"sparsity.sparsity=0.5 contradicts n=1, m=4"):
        SemiStructuredSparsity(n=1, m=4, sparsity=0.5)
    schedule = SemiStructuredSparsity(n=2, m=4, start_step=10, end_step=30, update_interval=10)
    plans = {step: schedule.plan(step) for step in range(40)}
    assert {s: (p.n, p.m) for s, p in plans.items() if p is not None} == {10: (3, 4), 20: (2, 4), 30: (2, 4)}
