"""2BW or a synchronous schedule (Flush, ZB-H1): which reaches a loss sooner at a planned rate. 2BW's rate over Flush's is the planner's; the steps
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
    never reached it), ``losses`` (each seed's final loss: Flush's, 2BW's at each run length), ``ratios`` (the
    planner's 2BW/Flush rates), ``date``, ``command``, ``optimizer``, ``page`` and ``heading`` (the docs' table)."""
    return json.loads(MEASURED.read_text()) if MEASURED.exists() else {}


def record(model: str, entry: dict) -> None:
    """Write one model's measurement (what ``delayed_rule.py --record`` measured), keeping the others."""
    entries = measured() | {model: entry}
    MEASURED.write_text(json.dumps(dict(sorted(entries.items())), indent=1) + "\n")


def overhead_text(entry: dict) -> str:
    """``1.06x +- 0.05 (3 seeds: 1.04 / 1.07 / 1.08)`` (the 95% interval's half-width); a seed that never reached the
    loss makes it a lower bound, one that reached it at the shortest horizon an upper bound (``<= 1.00``, counted at
    that value)."""
    values = entry["overheads"]
    reached = [v for v in values if v is not None]

    def one(v: float | None) -> str:
        return f"> {entry['longest']:.2f}" if v is None else f"{'<= ' * (v <= entry['shortest'])}{v:.2f}"

    seeds = " / ".join(one(v) for v in values)
    if len(reached) < len(values):
        return f"> {entry['longest']:.2f}x ({len(values)} seeds: {seeds})"
    bounds = interval(reached)
    spread = f" +- {bounds[2] - bounds[0]:.3f}" if bounds else ""
    return f"{statistics.mean(reached):.2f}x{spread} ({len(values)} seed{'s' * (len(values) > 1)}: {seeds})"


T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}  # t, 95%, two-sided


def interval(values: list[float]) -> tuple[float, float, float] | None:
    """The mean step overhead and its 95% interval over seeds (each seed's overhead is already paired: 2BW's steps
    over the same seed's Flush steps), Student's t with n - 1 degrees of freedom; None below 2 seeds."""
    if len(values) < 2:
        return None
    mean = statistics.mean(values)
    half = T95.get(len(values) - 1, 1.96) * statistics.stdev(values) / len(values) ** 0.5
    return mean, mean - half, mean + half


SYNCHRONOUS = {"flush": "Flush", "zb_h1": "ZB-H1"}  # the exact schedules, as the verdicts name them


def choice_text(twobw_rate: float, sync_rate: float, start_rate: float | None = None, sync: str = "Flush") -> str:
    """The line ``pd2bw-plan`` prints under its best plan: 2BW's and the best synchronous schedule's (``sync``: its
    name) planned rates, the step overhead that would make them equal, and what was measured. Every synchronous
    schedule trains by the same rule, so 2BW's step overhead over Flush's steps is its overhead over any of them.
    ``start_rate``: Flush's rule run in 2BW's layout (the synchronous start's steps are charged at it; default: the
    synchronous plan's rate)."""
    ratio = twobw_rate / sync_rate
    slowdown = sync_rate / start_rate if start_rate else 1.0
    start = f"; its synchronous start {start_rate:.1f} samples/s (Flush's rule in 2BW's layout)" if start_rate else ""
    lines = [
        f"2BW or {sync}: 2BW's best plan {twobw_rate:.1f} samples/s, {sync}'s {sync_rate:.1f} ({ratio:.2f}x): 2BW "
        f"reaches a loss sooner if it needs fewer than {ratio:.2f}x {sync}'s steps to it{start}"
    ]
    entries = measured()
    if not entries:
        return lines[0] + " (2BW's step overhead not measured)"
    for model, entry in entries.items():
        lines.append(
            f"  measured ({entry['date']}, held-out text): {model} {overhead_text(entry)}: "
            f"{verdict(entry, ratio, slowdown, sync)} at {ratio:.2f}x"
        )
    return "\n".join(lines) + "\n  (docs/time-to-quality.md)"


def time_ratio(entry: dict, overhead: float, ratio: float, slowdown: float = 1.0) -> float:
    """2BW's time over Flush's for a step overhead at rate ratio ``ratio``: steps over rate, a synchronous start's
    first steps (``sync_steps`` of the measured run's ``steps``) at Flush's rule, ``slowdown`` times Flush's best
    plan's step (Flush's rule run in 2BW's own layout)."""
    fresh = min(overhead, entry.get("sync_steps", 0) / entry.get("steps", 1))
    return fresh * slowdown + (overhead - fresh) / ratio


def break_even(entry: dict, ratio: float, slowdown: float = 1.0) -> float:
    """The step overhead at which 2BW and Flush reach the loss together (``time_ratio`` = 1)."""
    fresh = entry.get("sync_steps", 0) / entry.get("steps", 1)
    return fresh + (1 - fresh * slowdown) * ratio


def verdict(entry: dict, ratio: float, slowdown: float = 1.0, sync: str = "Flush") -> str:
    """Which mode reaches the loss sooner at rate ratio ``ratio``: "2BW sooner" or "Flush sooner" (``sync``: the
    synchronous schedule's name) only where the overhead's 95% interval lies on one side of the break-even overhead;
    a tie where it straddles it; one seed decides nothing."""
    values = entry["overheads"]
    if None in values:  # some seed needed more than the longest horizon
        return (
            f"{sync} sooner"
            if time_ratio(entry, entry["longest"], ratio, slowdown) >= 1
            else "undecided (longer horizons needed)"
        )
    even = break_even(entry, ratio, slowdown)
    bounds = interval(values)
    if bounds is None:
        return f"undecided (one seed: {values[0]:.3f}x against a break-even {even:.3f}x)"
    mean, low, high = bounds
    if high < even:
        return "2BW sooner"
    if low > even:
        return f"{sync} sooner"
    return f"a tie: 2BW's step overhead {mean:.3f}x +- {high - mean:.3f} against a break-even {even:.3f}x"


README_BLOCK = (
    "<!-- time-to-quality: generated by benchmarks/delayed_rule.py --record -->",
    "<!-- /time-to-quality -->",
)


def summary_table() -> str:
    """The measured overheads and what they mean at each recorded rate ratio, one row per model: the README's lead
    table (written between ``README_BLOCK``'s markers by ``delayed_rule.py --record``; a test keeps them equal)."""
    entries = measured()
    labels = list(dict.fromkeys(label for entry in entries.values() for label in entry.get("ratios", {})))
    head = "".join(f" 2BW's time to it at {label} |" for label in labels)
    lines = [
        f"| model (optimizer; peak learning rates) | 2BW's steps to Flush's final held-out loss |{head}",
        "|---" * (2 + len(labels)) + "|",
    ]
    for model, entry in entries.items():
        ratios = entry.get("ratios", {})
        values = entry["overheads"]
        times = []
        for label in labels:
            sync = entry.get("against", {}).get(label, "Flush")  # the fastest synchronous plan where it was planned
            slowdown = entry.get("slowdowns", {}).get(label, 1.0)  # the start's steps in 2BW's layout, as pd2bw-plan
            if label not in ratios:
                times.append("-")
            elif None in values:
                longest = time_ratio(entry, entry["longest"], ratios[label], slowdown)
                times.append(f"> {longest:.2f}x {sync}'s at {ratios[label]:.2f}x")
            else:
                time = time_ratio(entry, statistics.mean(values), ratios[label], slowdown)
                said = verdict(entry, ratios[label], slowdown, sync).split(":")[0].split(" (")[0]  # "a tie", ...
                times.append(f"{time:.2f}x {sync}'s at {ratios[label]:.2f}x ({said})")
        rates = entry.get("peak_lr")
        named = f"{model[:-1]}; Flush {short(rates['flush'])}, 2BW {short(rates['2bw'])})" if rates else model
        lines.append(f"| {named} ({entry['date']}) | {overhead_text(entry)} |" + "".join(f" {t} |" for t in times))
    return "\n".join(lines)


def with_summary(readme: str) -> str:
    """``readme`` with the text between ``README_BLOCK``'s markers replaced by ``summary_table()``."""
    begin, end = README_BLOCK
    if begin not in readme or end not in readme:
        raise ValueError(f"the README lacks the markers {begin} ... {end}")
    head, rest = readme.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{summary_table()}\n{end}{tail}"


def short(rate: float) -> str:
    """A learning rate as the docs write it: ``6e-4``, ``1.6e-2``."""
    mantissa, exponent = f"{rate:.1e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"
