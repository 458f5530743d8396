"""A Gantt chart of a pipeline timeline as a PNG: stages over time, as in the PipeDream papers.

Needs matplotlib (``pip install 'lightning_pd2bw[plot]'``). One row per stage (replica 0, or one row
per stage and replica); forwards and backwards are boxes labelled with their microbatch, coloured by
batch (forwards light, backwards dark); updates are red, their reductions and clipping orange, receives
(waiting on a neighbour) grey; white is idle.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..engine.schedules import schedule as S
from .timeline import StageTimeline, bubble_fraction

_REDUCTIONS = (S.REDUCE, S.CHECK, S.HOOKS, S.CLIP)

_BATCH_COLOURS = ["#4c72b0", "#55a868", "#8172b2", "#ccb974", "#64b5cd", "#937860"]


def _colour(kind: str, batch: int) -> tuple[str, float]:
    if kind == S.STEP:
        return "#d62728", 1.0
    if kind in _REDUCTIONS:
        return "#ff7f0e", 1.0
    if kind in (S.RECV_FORWARD, S.RECV_BACKWARD, S.WAIT_SENDS):
        return "#bbbbbb", 1.0
    if kind in (S.SEND_FORWARD, S.SEND_BACKWARD):
        return "#444444", 1.0
    base = _BATCH_COLOURS[batch % len(_BATCH_COLOURS)]
    return base, {S.FORWARD: 0.55, S.WEIGHT: 0.8}.get(kind, 1.0)


def draw_gantt(timelines: Sequence[StageTimeline], path: str | Path, title: str = "") -> Path:
    """Write the chart of ``timelines`` to ``path`` (PNG) and return the path."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ImportError("the Gantt chart needs matplotlib: pip install 'lightning_pd2bw[plot]'") from error
    rows = sorted(timelines, key=lambda t: (t.stage, t.replica))
    start = min((e.start for t in rows for e in t.events), default=0.0)
    end = max((e.end for t in rows for e in t.events), default=1.0)
    fig, ax = plt.subplots(figsize=(14, 0.9 * len(rows) + 1.4), dpi=110)
    for y, timeline in enumerate(rows):
        for event in timeline.events:
            colour, alpha = _colour(event.kind, event.batch)
            left, width = (event.start - start) * 1e3, event.seconds * 1e3
            height = 0.8 if event.kind in (S.FORWARD, S.BACKWARD, S.WEIGHT, S.STEP, *_REDUCTIONS) else 0.3
            ax.barh(y, width, left=left, height=height, color=colour, alpha=alpha, edgecolor="white", linewidth=0.3)
            if event.kind in (S.FORWARD, S.BACKWARD) and width > (end - start) * 1e3 / 120:
                label = f"{event.microbatch}" if event.kind == S.FORWARD else f"{event.microbatch}'"
                ax.text(left + width / 2, y, label, ha="center", va="center", fontsize=6, color="black")
    labels = []
    for timeline in rows:
        bubble = bubble_fraction(timeline.events, start, end) if timeline.events else 1.0
        name = f"stage {timeline.stage}" + (f" r{timeline.replica}" if len(rows) > len({t.stage for t in rows}) else "")
        labels.append(f"{name}\nbubble {bubble:.0%}")
    ax.set_yticks(range(len(rows)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_xlim(0, (end - start) * 1e3)
    ax.set_title(title or "pipeline timeline (light: forward, dark: backward, ' = backward; red: update)", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
