"""The concept picture of the docs' home page: stages x time x weight versions, Flush against 2BW, drawn from the
schedule generator itself (``python -m lightning_pd2bw.observe.concept docs/concept-2bw-vs-flush.png``; ``make
schedules``). Each cell is one forward (light) or backward (dark) of one microbatch, coloured by the weight version
it computes on; a red bar is an update; white is idle (the bubble)."""

from __future__ import annotations

import string
import sys

from ..engine import schedule as S
from .draw import timeline

VERSION_COLOURS = ["#4C78A8", "#F58518", "#54A24B", "#B279A2"]  # version 0, 1, 2, 3


def version_of(mode: str, batch: int) -> int:
    """The weight version a batch's microbatches compute on: flush, the newest (one per batch); 2BW, the one before
    (the first batch, version 0), so that two versions are held and none is waited for."""
    return batch if mode == "flush" else max(batch - 1, 0)


def draw(path: str, num_stages: int = 4, num_microbatches: int = 4, num_batches: int = 3) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    panels = [
        ("flush", "PipeDream-Flush: the pipeline drains before every update (white: the bubble)"),
        ("2bw", "PipeDream-2BW: no drain; each batch computes on the previous weight version (two held per stage)"),
    ]
    figure, axes = plt.subplots(2, 1, figsize=(16, 7.5))
    drawn = {mode: timeline(S.Mode(mode), num_stages, num_microbatches, num_batches) for mode, _ in panels}
    width = max(len(row) for rows in drawn.values() for row in rows)  # one time axis: 2BW ends sooner
    for axis, (mode, title) in zip(axes, panels):
        rows = drawn[mode]
        for stage, row in enumerate(rows):
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
                label = ("F" if forward else "B") + f"{cell[0].upper()}{cell[1:]}"
                axis.text(
                    slot + 0.5,
                    y + 0.5,
                    label,
                    ha="center",
                    va="center",
                    fontsize=9,
                    color="black" if forward else "white",
                )
        axis.set_xlim(0, width)
        axis.set_ylim(0, num_stages)
        axis.set_yticks([num_stages - 0.5 - s for s in range(num_stages)], [f"stage {s}" for s in range(num_stages)])
        axis.set_xticks([])
        axis.set_xlabel("time (one slot = one microbatch's forward or backward on one stage)", fontsize=10)
        axis.set_title(title, fontsize=13, loc="left")
        for side in ("top", "right"):
            axis.spines[side].set_visible(False)
    legend = [Patch(color=c, label=f"weight version {v}") for v, c in enumerate(VERSION_COLOURS[:num_batches])]
    legend += [Patch(color="#D62728", label="an update"), Patch(color="grey", alpha=0.45, label="F = forward (light)")]
    legend += [Patch(color="grey", label="B = backward (dark)")]
    figure.legend(handles=legend, loc="lower center", ncol=6, fontsize=10, frameon=False)
    figure.text(
        0.01,
        0.955,
        f"d = {num_stages} stages, m = {num_microbatches} microbatches per batch (A, B, C), {num_batches} batches; "
        "FA0 = the forward of batch A's microbatch 0",
        fontsize=10,
    )
    figure.tight_layout(rect=(0, 0.05, 1, 0.95))
    figure.savefig(path, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    draw(sys.argv[1] if len(sys.argv) > 1 else "concept-2bw-vs-flush.png")
