"""Text pictures of the schedules, drawn from ``schedule.py`` itself (``python -m lightning_pd2bw.observe.draw``).

Time runs left to right in unit slots (a forward takes one slot, a backward ``backward_slots``; sends are free).
Each cell shows the microbatch's batch letter and index: upper case for forwards, lower case for
backwards, ``|`` for an update, ``.`` for idle (the bubble). A split backward (``zb_h1``) is its B (lower case, one
slot: the input gradient) and its W (lower case with ``w``, one slot: the deferred weight gradients).
"""

from __future__ import annotations

import string

from ..engine.layout import Layout
from ..engine.schedules import schedule as S


def timeline(
    mode: S.Mode,
    num_stages: int,
    num_microbatches: int,
    num_batches: int,
    lookahead: int = 0,
    backward_slots: int = 1,
) -> list[list[str]]:
    """Simulate the stages with unit-time compute and instantaneous messages (an undivided backward takes
    ``backward_slots``: 2 where it is drawn beside a split one, whose B and W take one each)."""
    split = Layout(num_stages, num_microbatches, mode, lookahead=lookahead).mode.splits_backward
    actions = [
        [
            a
            for a in S.stream(Layout(num_stages, num_microbatches, mode, lookahead=lookahead), s, num_batches)
            if a.kind in (S.FORWARD, S.BACKWARD, S.WEIGHT, S.REDUCE)
        ]
        for s in range(num_stages)
    ]
    ready: dict[tuple[str, int, int], int] = {}  # (kind, stage, microbatch) -> time its input is available
    rows: list[list[str]] = [[] for _ in range(num_stages)]
    position = [0] * num_stages
    running: list[tuple[str, int]] = [("", 0)] * num_stages  # (label, slots left) of a backward longer than a slot
    time = 0
    while any(position[s] < len(actions[s]) or running[s][1] for s in range(num_stages)):
        done = []
        for stage in range(num_stages):
            label, left = running[stage]
            if left:
                rows[stage].append(label)
                running[stage] = (label, left - 1)
                continue
            if position[stage] >= len(actions[stage]):
                rows[stage].append(" ")
                continue
            action = actions[stage][position[stage]]
            if action.kind == S.REDUCE:  # "|": an update begins (2BW completes it beside the next batch)
                rows[stage].append("|")
                position[stage] += 1
                continue
            k, batch = action.microbatch, action.batch
            need = None
            if action.kind == S.FORWARD and stage > 0:
                need = ("F", stage - 1, k)
            if action.kind == S.BACKWARD and stage < num_stages - 1:
                need = ("B", stage + 1, k)
            if need is not None and ready.get(need, 1 << 30) > time:
                rows[stage].append(".")
                continue
            letter = string.ascii_uppercase[batch % 26]
            label = f"{letter}{k % num_microbatches}"
            label = {S.FORWARD: label, S.BACKWARD: label.lower(), S.WEIGHT: label.lower() + "w"}[action.kind]
            rows[stage].append(label)
            slots = backward_slots if action.kind == S.BACKWARD and not split else 1
            running[stage] = (label, slots - 1)
            done.append((action.kind, stage, k, slots))
            position[stage] += 1
        for kind, stage, k, slots in done:
            ready[(kind, stage, k)] = time + slots
        time += 1
    return rows


def render(mode: S.Mode, num_stages: int, num_microbatches: int, num_batches: int, backward_slots: int = 1) -> str:
    rows = timeline(mode, num_stages, num_microbatches, num_batches, backward_slots=backward_slots)
    width = max(len(c) for r in rows for c in r)
    slots = f", a backward {backward_slots} slots" if backward_slots > 1 and mode != "zb_h1" else ""
    lines = [f"{mode} (d={num_stages}, m={num_microbatches}, {num_batches} batches{slots}):"]
    for stage, row in enumerate(rows):
        lines.append(f"  stage {stage}: " + " ".join(c.ljust(width) for c in row).rstrip())
    return "\n".join(lines)


def main() -> None:
    for mode, batches in (("flush", 2), ("2bw", 3)):  # each within the docs' code width (120 characters)
        print(render(mode, 4, 4, batches))
        print()
    for mode in ("flush", "zb_h1"):  # F, B and W a slot each: the bubble ZB-H1 fills
        print(render(mode, 4, 8, 1, backward_slots=2))
        print()


if __name__ == "__main__":
    main()
