"""2BW or Flush: which reaches a loss sooner at a planned rate. 2BW's rate over Flush's is the planner's; the steps
2BW needs over Flush's to reach Flush's loss are measured (``benchmarks/delayed_rule.py --horizons --record``,
written to ``step_overhead.json`` beside this module). 2BW is there sooner exactly when its step overhead is below
its rate ratio: time = steps / rate."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

MEASURED = Path(__file__).with_name("step_overhead.json")


def measured() -> dict[str, dict]:
    """Per model: ``overheads`` (2BW's steps to Flush's final held-out loss over Flush's, per seed; None where a seed
    never reached it), ``date``, ``command``, ``optimizer``."""
    return json.loads(MEASURED.read_text()) if MEASURED.exists() else {}


def record(model: str, entry: dict) -> None:
    """Write one model's measurement (what ``delayed_rule.py --record`` measured), keeping the others."""
    entries = measured() | {model: entry}
    MEASURED.write_text(json.dumps(dict(sorted(entries.items())), indent=1) + "\n")


def overhead_text(entry: dict) -> str:
    """``1.06x (3 seeds: 1.04 / 1.07 / 1.08)``; a seed that never reached the loss makes it a lower bound, one that
    reached it at the shortest horizon an upper bound (``<= 1.00``)."""
    values = entry["overheads"]
    reached = [v for v in values if v is not None]

    def one(v: float | None) -> str:
        return f"> {entry['longest']:.2f}" if v is None else f"{'<= ' * (v <= entry['shortest'])}{v:.2f}"

    seeds = " / ".join(one(v) for v in values)
    if len(reached) < len(values):
        return f"> {entry['longest']:.2f}x ({len(values)} seeds: {seeds})"
    return f"{statistics.mean(reached):.2f}x ({len(values)} seed{'s' * (len(values) > 1)}: {seeds})"


def choice_text(twobw_rate: float, flush_rate: float) -> str:
    """The line ``pd2bw-plan`` prints under its best plan: both modes' planned rates, the step overhead that would make
    them equal, and what was measured."""
    ratio = twobw_rate / flush_rate
    lines = [
        f"2BW or Flush: 2BW's best plan {twobw_rate:.1f} samples/s, Flush's {flush_rate:.1f} ({ratio:.2f}x): 2BW "
        f"reaches a loss sooner if it needs fewer than {ratio:.2f}x Flush's steps to it"
    ]
    entries = measured()
    if not entries:
        return lines[0] + " (2BW's step overhead not measured)"
    for model, entry in entries.items():
        lines.append(
            f"  measured ({entry['date']}, {entry['optimizer']}, held-out text): {model} {overhead_text(entry)}: "
            f"{verdict(entry, ratio)} at {ratio:.2f}x"
        )
    return "\n".join(lines) + "\n  (docs/quality.md: time to quality)"


def verdict(entry: dict, ratio: float) -> str:
    """Which mode reaches the loss sooner at rate ratio ``ratio``, from one measurement."""
    values = entry["overheads"]
    if None in values:  # some seed needed more than the longest horizon
        return "Flush sooner" if entry["longest"] >= ratio else "undecided (longer horizons needed)"
    return "2BW sooner" if statistics.mean(values) < ratio else "Flush sooner"
