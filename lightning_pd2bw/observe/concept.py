"""The concept picture of the docs' home page: stages x time x weight versions, Flush against 2BW, drawn from the
schedule generator itself (``python -m lightning_pd2bw.observe.concept docs/concept-2bw-vs-flush.png``; ``make
schedules``). Each cell is one forward (light) or backward (dark) of one microbatch, coloured by the weight version
it computes on; a red bar is an update; white is idle (the bubble)."""

from __future__ import annotations

import string
import sys

from ..engine.schedules import schedule as S
from .draw import timeline

VERSION_COLOURS = ["#4C78A8", "#F58518", "#54A24B", "#B279A2"]  # version 0, 1, 2, 3


def version_of(mode: str, batch: int) -> int:
    """The weight version a batch's microbatches compute on: flush, the newest (one per batch); 2BW, the one before
    (the first batch, version 0), so that two versions are held and none is waited for (``schedule.weight_version``)."""
    return S.weight_version(S.Mode(mode), batch)


def draw(path: str, num_stages: int = 4, num_microbatches: int = 4, num_batches: int = 3) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    panels = [
        ("flush", "Flush: the pipeline drains before every update (white: the bubble)"),
        ("2bw", "2BW: no drain; each batch computes on the previous weight version"),
    ]
    figure, axes = plt.subplots(2, 1, figsize=(12, 6.8))
    drawn = {mode: timeline(S.Mode(mode), num_stages, num_microbatches, num_batches) for mode, _ in panels}
    width = max(len(row) for rows in drawn.values() for row in rows)  # one time axis: 2BW ends sooner
    for axis, (mode, title) in zip(axes, panels):
        for stage, row in enumerate(drawn[mode]):
            y = num_stages - 1 - stage
            for slot, cell in enumerate(row):
                if cell == "|":
                    axis.add_patch(Rectangle((slot + 0.35, y + 0.02), 0.3, 0.96, color="#D62728"))
                    continue
                if cell in (" ", "."):
                    continue
                batch = string.ascii_uppercase.index(cell[0].upper())
                colour = VERSION_COLOURS[version_of(mode, batch) % len(VERSION_COLOURS)]
                forward = cell[0].isupper()
                axis.add_patch(
                    Rectangle((slot + 0.03, y + 0.05), 0.94, 0.9, color=colour, alpha=0.45 if forward else 1)
                )
                ink = "black" if forward else "white"
                axis.text(slot + 0.5, y + 0.5, cell, ha="center", va="center", fontsize=11, color=ink)
        axis.set_xlim(0, width)
        axis.set_ylim(0, num_stages)
        ticks = [num_stages - 0.5 - s for s in range(num_stages)]
        axis.set_yticks(ticks, [f"stage {s}" for s in range(num_stages)], fontsize=11)
        axis.set_xticks([])
        axis.set_xlabel("time: one slot = one microbatch's forward or backward on one stage", fontsize=11)
        axis.set_title(title, fontsize=13, loc="left")
        for side in ("top", "right"):
            axis.spines[side].set_visible(False)
    legend = [Patch(color=c, label=f"weight version {v}") for v, c in enumerate(VERSION_COLOURS[:num_batches])]
    legend += [Patch(color="#D62728", label="update"), Patch(color="grey", alpha=0.45, label="A0: forward")]
    legend += [Patch(color="grey", label="a0: backward")]
    figure.legend(handles=legend, loc="lower center", ncol=6, fontsize=11, frameon=False)
    caption = f"d = {num_stages} stages, m = {num_microbatches} microbatches per batch, batches A, B, C"
    figure.text(0.01, 0.955, caption + "; A0 = batch A's microbatch 0", fontsize=11)
    figure.tight_layout(rect=(0, 0.06, 1, 0.95))
    figure.savefig(path, dpi=100)
    plt.close(figure)


if __name__ == "__main__":
    draw(sys.argv[1] if len(sys.argv) > 1 else "concept-2bw-vs-flush.png")
