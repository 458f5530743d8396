"""Which mode reaches a loss sooner, from the planned rates and the measured step overhead (time = steps / rate)."""

import json
from pathlib import Path

import pytest

from lightning_pd2bw.planner import step_overhead

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def measured(tmp_path, monkeypatch):
    path = tmp_path / "step_overhead.json"
    monkeypatch.setattr(step_overhead, "MEASURED", path)
    return path


def entry(*overheads, shortest=1.0, longest=1.25):
    return {"overheads": list(overheads), "shortest": shortest, "longest": longest, "optimizer": "adamw", "date": "d"}


def test_2bw_is_sooner_exactly_when_the_overheads_interval_lies_below_its_rate_ratio():
    """Issue 94: a verdict only where the 95% interval over seeds lies on one side of the break-even overhead; a tie
    where it straddles it; one seed decides nothing."""
    assert step_overhead.verdict(entry(1.04, 1.05, 1.06), 1.15) == "2BW sooner"
    assert step_overhead.verdict(entry(1.18, 1.19, 1.20), 1.15) == "Flush sooner"
    assert step_overhead.verdict(entry(1.10, 1.15, 1.20), 1.15) == (
        "a tie: 2BW's step overhead 1.150x +- 0.124 against a break-even 1.150x"
    )
    assert step_overhead.verdict(entry(1.04), 1.15).startswith("undecided (one seed")
    # by hand: 1, 2, 3 have mean 2, standard deviation 1; t(0.975, 2 degrees of freedom) = 4.303
    mean, low, high = step_overhead.interval([1.0, 2.0, 3.0])
    assert (mean, high - mean) == pytest.approx((2.0, 4.303 / 3**0.5))
    # a seed that never reached Flush's loss by 1.25x: Flush is sooner at any ratio up to 1.25, undecided above
    assert step_overhead.verdict(entry(1.04, None), 1.15) == "Flush sooner"
    assert step_overhead.verdict(entry(1.04, None), 1.4) == "undecided (longer horizons needed)"


def test_the_plan_line_reads_the_recorded_measurement(measured):
    assert "not measured" in step_overhead.choice_text(163.1, 141.7)
    step_overhead.record("gpt_small (adamw)", entry(1.09, 1.10, 1.11))
    step_overhead.record("gpt_tiny (adamw)", entry(1.0, 1.02))
    assert set(json.loads(measured.read_text())) == {"gpt_small (adamw)", "gpt_tiny (adamw)"}  # both kept
    text = step_overhead.choice_text(163.1, 141.7)
    assert "fewer than 1.15x Flush's steps" in text
    assert "gpt_small (adamw) 1.10x +- 0.025 (3 seeds: 1.09 / 1.10 / 1.11): 2BW sooner at 1.15x" in text
    assert "gpt_tiny (adamw) 1.01x +- 0.127 (2 seeds: <= 1.00 / 1.02)" in text  # reached at the shortest run: a bound
    assert "Flush sooner at 1.05x" in step_overhead.choice_text(105.0, 100.0)


def test_the_readme_and_quality_pages_time_to_quality_table_is_the_recorded_one():
    """The README's lead table is generated from ``step_overhead.json`` (``delayed_rule.py --record`` rewrites it):
    a figure typed there by hand, or a measurement recorded without it, fails here."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    assert step_overhead.with_summary(readme) == readme
    included = root / "docs" / "_generated" / "time-to-quality-summary.md"  # docs/quality.md's lead
    assert included.read_text() == step_overhead.summary_table() + "\n"


def test_the_summary_states_the_time_at_each_recorded_ratio(measured):
    step_overhead.record("m (adamw)", entry(1.11, 1.12, 1.13) | {"ratios": {"gpt13b (planned)": 1.15}})
    table = step_overhead.summary_table()
    assert (
        "| m (adamw) (d) | 1.12x +- 0.025 (3 seeds: 1.11 / 1.12 / 1.13) | 0.97x Flush's at 1.15x (2BW sooner) |"
        in table
    )
    step_overhead.record("m (adamw)", entry(1.10, None) | {"ratios": {"gpt13b (planned)": 1.15}})
    assert "> 1.09x Flush's at 1.15x" in step_overhead.summary_table()  # 1.25 / 1.15: a seed past the longest run


def test_a_synchronous_starts_steps_run_at_flushs_rate():
    """250 of 2,000 steps drain (Flush's speed): 2BW at 1.0x the steps and 1.25x the rate takes
    0.125 + 0.875 / 1.25 = 0.825 of Flush's time, not 0.8."""
    started = entry(1.0, 1.0) | {"sync_steps": 250, "steps": 2000}
    assert step_overhead.time_ratio(started, 1.0, 1.25) == pytest.approx(0.825)
    assert step_overhead.time_ratio(entry(1.0), 1.0, 1.25) == pytest.approx(0.8)
    # break-even 0.125 + 0.875 x 1.1 = 1.0875: the interval 1.13 +- 0.025 lies above it
    assert step_overhead.verdict(started | {"overheads": [1.12, 1.13, 1.14]}, 1.1) == "Flush sooner"
    assert step_overhead.break_even(started, 1.1) == pytest.approx(1.0875)
    # the start's steps charged at Flush's rule in 2BW's own layout, 3.2% slower than Flush's best plan (gpt13b)
    assert step_overhead.time_ratio(started, 1.0, 1.25, slowdown=1.032) == pytest.approx(0.125 * 1.032 + 0.7)
    assert step_overhead.break_even(started, 1.25, slowdown=1.032) == pytest.approx(0.125 + (1 - 0.129) * 1.25)


def test_the_summary_charges_the_start_as_pd2bw_plan_does(measured):
    """The README's verdict and ``pd2bw-plan``'s agree: both charge a synchronous start's steps at Flush's rule in
    2BW's own layout (the record's ``slowdowns``, from the planned rates). By hand: 250 of 1,000 steps at 1.25x the
    synchronous plan's step, the rest at 1/1.10: break-even 0.25 + (1 - 0.3125) x 1.10 = 1.00625, below the interval
    1.03 +- 0.0025; with the start at the synchronous plan's own rate 0.25 + 0.75 x 1.10 = 1.075, above it."""
    started = entry(1.029, 1.03, 1.031) | {"sync_steps": 250, "steps": 1000, "ratios": {"v100 (planned)": 1.10}}
    step_overhead.record("m (adamw)", started | {"slowdowns": {"v100 (planned)": 1.25}})
    assert step_overhead.break_even(started, 1.10, 1.25) == pytest.approx(1.00625)
    assert "(Flush sooner)" in step_overhead.summary_table()
    assert "Flush sooner at 1.10x" in step_overhead.choice_text(110.0, 100.0, start_rate=80.0)
    step_overhead.record("m (adamw)", started)  # no slowdown recorded: the start at the synchronous plan's rate
    assert "(2BW sooner)" in step_overhead.summary_table()


def test_each_measurements_page_is_drawn_from_its_record():
    """Every ``docs/_generated/time-to-quality-*.md`` is ``page_text`` of its record in ``step_overhead.json`` (the
    losses per seed, the steps ratios, the planner's rate ratios of today): ``--replan`` moves the time columns and the
    plots with the planner, so no page keeps a ratio the summary no longer states."""
    from benchmarks.time_to_quality import page_text

    entries = step_overhead.measured()
    pages = {path.stem for path in (ROOT / "docs" / "_generated").glob("time-to-quality-*.md")} - {
        "time-to-quality-summary"
    }
    assert pages == {entry["page"] for entry in entries.values()}
    for entry in entries.values():
        assert (ROOT / "docs" / "_generated" / f"{entry['page']}.md").read_text() == page_text(entry), entry["page"]
        assert (ROOT / "docs" / f"{entry['page']}.png").is_file()
        labels = [line for line in page_text(entry).splitlines() if line.startswith("| seed")][0]
        assert all(f"{ratio:.2f}x ({label})" in labels for label, ratio in entry["ratios"].items())
