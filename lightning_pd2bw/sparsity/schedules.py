"""Sparsity schedules as pure functions of the optimizer step (no tensors, no Lightning).

A density is the fraction of a layer's weights that are kept (1.0 = dense); sparsity = 1 - density.

- Gradual magnitude pruning (Zhu & Gupta 2017, "To prune, or not to prune"): the sparsity rises
  from ``s_i`` at ``start_step`` to ``s_f`` at ``end_step`` along
  ``s(t) = s_f + (s_i - s_f) * (1 - (t - start) / (end - start)) ** 3``, evaluated only on update
  steps ``start, start + interval, ...`` (cubic: prune fast while the network is redundant, slowly
  at the end). ``linear`` replaces the cube by the first power.
- N:M semi-structured (2:4, what GPUs' sparse tensor cores run): at most N non-zeros in each group of M consecutive
  weights along the GEMM's reduction dimension. Gradually (dense to N:M over a window, as gradual pruning): the
  kept count per group falls from M - 1 to N, each count held for an equal part of the window, the mask recomputed
  at each update step, then fixed.
- RigL (Evci et al. 2020): the fraction of active weights dropped (and regrown) at an update step
  decays as ``alpha / 2 * (1 + cos(pi * t / end_step))`` and is zero from ``end_step`` on.
"""

from __future__ import annotations

import math

SHAPES = ("cubic", "linear")


def is_update_step(step: int, start_step: int, end_step: int, interval: int) -> bool:
    """Masks change on ``start_step``, every ``interval`` steps after it, and on ``end_step``."""
    if step < start_step or step > end_step:
        return False
    return (step - start_step) % interval == 0 or step == end_step


def gradual_density(
    step: int,
    start_step: int,
    end_step: int,
    interval: int,
    final_density: float,
    initial_density: float = 1.0,
    shape: str = "cubic",
) -> float:
    """The target density in force at ``step`` (held between update steps)."""
    if shape not in SHAPES:
        raise ValueError(f"schedule shape={shape!r} is not valid; valid: {', '.join(SHAPES)}")
    if step < start_step:
        return initial_density
    if step >= end_step:
        return final_density
    last_update = start_step + (step - start_step) // interval * interval
    progress = (last_update - start_step) / (end_step - start_step)
    power = 3 if shape == "cubic" else 1
    initial_sparsity, final_sparsity = 1 - initial_density, 1 - final_density
    sparsity = final_sparsity + (initial_sparsity - final_sparsity) * (1 - progress) ** power
    return 1 - sparsity


def n_of_m_at(step: int, start_step: int, end_step: int, n: int, m: int) -> int:
    """The weights kept per group of ``m`` at ``step``: ``m`` (dense) before ``start_step``; then ``m - 1``, ``m - 2``,
    ... ``n``, each held for an equal part of the window (the first pruning at ``start_step``); ``n`` from the last
    part on, and after ``end_step``."""
    if step < start_step:
        return m
    levels = m - n
    if step >= end_step:
        return n
    part = math.floor(levels * (step - start_step) / (end_step - start_step))
    return m - 1 - min(levels - 1, part)


def rigl_drop_fraction(step: int, end_step: int, alpha: float) -> float:
    """Fraction of each layer's active weights dropped and regrown at ``step`` (cosine decay)."""
    if step >= end_step:
        return 0.0
    return alpha / 2 * (1 + math.cos(math.pi * step / end_step))


def rewarmup_factor(step: int, changed_at: int, rewarmup_steps: int) -> float:
    """Learning-rate multiplier after a mask change at step ``changed_at``: linear from 1/W back to 1 over W steps."""
    if step < changed_at or rewarmup_steps <= 0:
        return 1.0
    return min(1.0, (step - changed_at + 1) / rewarmup_steps)


def restart_lr(step: int, start: int, end: int, peak: float, floor: float = 0.1) -> float:
    """A learning-rate schedule of its own from ``start`` to ``end`` (SPDF's dense phase): ``peak`` at ``start``,
    cosine down to ``floor * peak`` at ``end`` (held after)."""
    progress = min(1.0, max(0.0, (step - start) / max(1, end - start)))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))
