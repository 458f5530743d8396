"""Text pictures of the schedules, drawn from ``schedule.py`` itself (``python -m lightning_pd2bw.observe.draw``).

Time runs left to right in unit slots (a forward or a backward takes one slot; sends are free).
Each cell shows the microbatch's batch letter and index: upper case for forwards, lower case for
backwards, ``|`` for an update, ``.`` for idle (the bubble).
"""

from __future__ import annotations

import string

from ..engine.layout import Layout
from ..engine.schedules import schedule as S


def timeline(
    mode: S.Mode, num_stages: int, num_microbatches: int, num_batches: int, lookahead: int = 0
) -> list[list[str]]:
    """Simulate the stages with unit-time compute and instantaneous messages."""
    actions = [
        [
            a
            for a in S.stream(Layout(num_stages, num_microbatches, mode, lookahead=lookahead), s, num_batches)
            if a.kind in (S.FORWARD, S.BACKWARD, S.REDUCE)
        ]
        for s in range(num_stages)
    ]
    ready: dict[tuple[str, int, int], int] = {}  # (kind, stage, microbatch) -> time its input is available
    rows: list[list[str]] = [[] for _ in range(num_stages)]
    position = [0] * num_stages
    time = 0
    while any(position[s] < len(actions[s]) for s in range(num_stages)):
        done = []
        for stage in range(num_stages):
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
            rows[stage].append(label if action.kind == S.FORWARD else label.lower())
            done.append((action.kind, stage, k))
            position[stage] += 1
        for kind, stage, k in done:
            ready[(kind, stage, k)] = time + 1
        time += 1
    return rows


def render(mode: S.Mode, num_stages: int, num_microbatches: int, num_batches: int) -> str:
    rows = timeline(mode, num_stages, num_microbatches, num_batches)
    width = max(len(c) for r in rows for c in r)
    lines = [f"{mode} (d={num_stages}, m={num_microbatches}, {num_batches} batches):"]
    for stage, row in enumerate(rows):
        lines.append(f"  stage {stage}: " + " ".join(c.ljust(width) for c in row).rstrip())
    return "\n".join(lines)


def main() -> None:
    for mode, batches in (("flush", 2), ("2bw", 3)):  # each within the docs' code width (120 characters)
        print(render(mode, 4, 4, batches))
        print()


if __name__ == "__main__":
    main()
