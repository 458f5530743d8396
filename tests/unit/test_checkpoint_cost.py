"""The dry run's checkpoint cost (issue 60): blocking time per save from the measured staging rate, the work a
failure loses, and the shortest interval under 1% blocked, by hand; and the gpt13b recipe's line."""

from __future__ import annotations

import pytest

from lightning_pd2bw.planner.checkpoint_cost import BLOCKING_S_PER_GIB, WRITE_S_PER_GIB, CheckpointCost, GiB

from ..cli import run_cli


def test_the_cost_by_hand():
    cost = CheckpointCost(10 * GiB, 100 * GiB, 64, interval=50, step_s=6.0, asynchronous=True)
    blocked = 10 * BLOCKING_S_PER_GIB["cuda"]
    assert cost.blocking_s == pytest.approx(blocked)
    assert cost.background_s == pytest.approx(10 * WRITE_S_PER_GIB)
    assert cost.overhead() == pytest.approx(blocked / (50 * 6.0))
    assert cost.loss_per_failure_gpu_hours() == pytest.approx(25 * 6.0 * 64 / 3600)
    # the blocking bound (0.2 s / 0.06 s -> 4) and the background bound (14.2 s / 6 s -> 3): the larger
    assert cost.shortest_interval() == max(4, 3)
    sync = CheckpointCost(10 * GiB, 100 * GiB, 64, interval=50, step_s=6.0, asynchronous=False)
    assert sync.blocking_s == pytest.approx(10 * WRITE_S_PER_GIB) and sync.background_s == 0
    assert sync.shortest_interval() == 237  # 14.2 s is under 1% of 237 steps of 6 s
    assert "needs a cluster" in CheckpointCost(GiB, GiB, 2, 10, None, True).describe()


def test_the_gpt13b_dry_run_plans_its_checkpoints(tmp_path):
    result = run_cli(
        "recipe=gpt13b", "dry_run=true", "+cluster=h100_80g_8x8", f"paths.output_dir={tmp_path}", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("checkpoint:"))
    assert "async: every rank blocked" in line and "every 50 steps" in line and "GPU-hours" in line
    shortest = int(line.rsplit("from every ", 1)[1].split()[0])
    assert shortest <= 50, "the recipe's interval keeps blocking under 1%"


def test_the_gpt13b_recipe_is_planned_at_nine_tenths_of_the_clusters_ideal_rate(tmp_path):
    """Issue 62: the recipe's own layout planned at >= 0.90 of the cluster's ideal rate (every GPU computing the
    model's layers at the recipe's micro size on the device's roofline, nothing else)."""
    result = run_cli(
        "recipe=gpt13b", "dry_run=true", "+cluster=h100_80g_8x8", f"paths.output_dir={tmp_path}", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("plan:"))
    rate = float(line.split()[1])
    ideal = float(line.split(" of the ideal ")[1].split(")")[0])
    assert rate / ideal >= 0.90, line


def test_the_preemption_lead_is_a_step_the_drain_and_the_synchronous_save():
    """Issue 78, 6: SIGTERM needs the step in progress, the drain (one more step at most) and the fullest rank's
    synchronous save; the suggested ``--signal`` lead is twice that, in whole minutes."""
    cost = CheckpointCost(13.8 * GiB, 99.7 * GiB, 64, 50, step_s=5.5, asynchronous=True)
    needed = 2 * 5.5 + 13.8 * WRITE_S_PER_GIB
    assert cost.preemption_s == pytest.approx(needed)
    assert f"preemption: {needed:.0f} s" in cost.preemption_text()
    assert "--signal=SIGTERM@120 " in cost.preemption_text()  # 2 x 30.6 s = 61 s: two minutes
    no_cluster = CheckpointCost(13.8 * GiB, 99.7 * GiB, 64, 50, step_s=None, asynchronous=True)
    assert no_cluster.preemption_s is None and "needs a cluster" in no_cluster.preemption_text()
