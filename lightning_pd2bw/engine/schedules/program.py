"""Every stage's program as text, and back: the action lists ``schedule.py`` generates for a run (its steps and the
drain), written one action per line as ``stage,index,action`` (as torch's ``_dump_csv`` / ``_load_csv`` write a
schedule), for a trace, a test or a bug report.

    python -m lightning_pd2bw.engine.schedules.program --mode zb_h1 --stages 4 --microbatches 8 --steps 2

``load`` reads the text back into the same ``Action`` lists (``Action.parse``), so a program written by one version
can be compared with what another generates, action by action.
"""

from __future__ import annotations

import argparse
import csv
import io
from collections.abc import Mapping, Sequence

from ..layout import MODES, Layout
from . import schedule as S

HEADER = ("stage", "index", "action")


def programs(layout: Layout, steps: int) -> dict[int, list[S.Action]]:
    """Each stage's actions for ``steps`` training steps and the drain that ends the run (``schedule.stream``)."""
    return {stage: S.stream(layout, stage, steps) for stage in range(layout.num_stages)}


def dump(programs_by_stage: Mapping[int, Sequence[S.Action]]) -> str:
    """``stage,index,action`` lines under a header, stages in order."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(HEADER)
    for stage in sorted(programs_by_stage):
        for index, action in enumerate(programs_by_stage[stage]):
            writer.writerow((stage, index, str(action)))
    return out.getvalue()


def load(text: str, num_microbatches: int) -> dict[int, list[S.Action]]:
    """What ``dump`` wrote, back as each stage's actions; a line out of order or not an action is refused by its
    line number."""
    rows = list(csv.reader(io.StringIO(text)))
    if not rows or tuple(rows[0]) != HEADER:
        raise ValueError(f"a program's text starts with the header {','.join(HEADER)}")
    loaded: dict[int, list[S.Action]] = {}
    for number, row in enumerate(rows[1:], start=2):
        if len(row) != 3:
            raise ValueError(f"line {number}: {','.join(row)!r} is not stage,index,action")
        stage, index = int(row[0]), int(row[1])
        actions = loaded.setdefault(stage, [])
        if index != len(actions):
            raise ValueError(f"line {number}: stage {stage}'s action #{index} follows #{len(actions) - 1}")
        try:
            actions.append(S.Action.parse(row[2], num_microbatches))
        except ValueError as error:
            raise ValueError(f"line {number}: {error}") from None
    return loaded


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=MODES, default="2bw")
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=None)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    print(dump(programs(Layout(args.stages, args.microbatches, args.mode), args.steps)), end="")


if __name__ == "__main__":
    main()
