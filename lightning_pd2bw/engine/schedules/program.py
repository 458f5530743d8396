"""A rank's whole program as data: what one stage runs for a training step, a drain and a whole run of them, as
``Action`` lists; written one action per line as ``stage,index,action`` (as torch's ``_dump_csv`` / ``_load_csv``
write a schedule) and read back, for a trace, a test or a bug report.

    python -m lightning_pd2bw.engine.schedules.program --mode 2bw --stages 2 --steps 3 --sync-steps 1 --flag

A training step is the schedule's segment (``schedule.segment``) with its head and end as actions
(``actions.STEP_KINDS``): ``FLAG`` (the strategy's stop agreement, where it has one), then under a draining schedule
``DRAINED``, ``TAKE_LOSS`` of the step's own batch and ``RESTART``; under 2BW ``TAKE_LOSS`` of the previous batch
(its broadcast overlapped this one); in 2BW's synchronous start, the step's drain (``drain``) at once, so its loss
is its own and the next step reads fresh weights. A drain is ``schedule.drain``'s actions then ``DRAINED``,
``SETTLE``, ``TAKE_LOSS`` of the last batch and ``RESTART``; the run's last adds ``LAST_FLAG``. A stage's setup
(``setup``) makes its replicas and its tied parameters' copies start equal.

Three readers run these lists: the engine (``PipelineEngine.train_batch`` / ``drain``, through
``executor.StageExecutor.run``), the NCCL model (``verify/comm_plan.py``) and the planner's simulator
(``planner/simulate.py``). None decides on its own how a step ends, when the synchronous start drains, or which loss a
step returns.
"""

from __future__ import annotations

import argparse
import csv
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..layout import MODES, Layout
from . import schedule as S

HEADER = ("stage", "index", "action")


@dataclass(frozen=True)
class Scenario:
    """A run as its ranks see it: ``steps`` training steps, the first ``sync_steps`` of 2BW drained (its synchronous
    start), a drain after each step in ``drain_after`` (1-based: validation, a checkpoint), and ``flag``: the
    strategy's stop agreement at each step's head (Lightning's; the engine alone has none)."""

    steps: int = 3
    sync_steps: int = 0
    drain_after: tuple[int, ...] = ()
    flag: bool = False

    def synchronous(self, layout: Layout, step: int) -> bool:
        """Whether training step ``step`` (0-based over the run) is one of 2BW's synchronous start."""
        return layout.mode.double_buffered and step < self.sync_steps


def train_step(
    layout: Layout, stage: int, batch: int, *, synchronous: bool = False, flag: bool = False
) -> list[S.Action]:
    """Training step ``batch`` (0-based since the last drain) on ``stage``: its segment with its head and end."""
    head = [S.Action(S.FLAG, batch)] if flag else []
    actions = [*head, *S.segment(layout, stage, batch)]
    if layout.mode.flushes:
        return [*actions, S.Action(S.DRAINED, batch), S.Action(S.TAKE_LOSS, batch), S.Action(S.RESTART, batch)]
    if synchronous:
        return [*actions, *drain(layout, stage, batch)]
    return [*actions, *([S.Action(S.TAKE_LOSS, batch - 1)] if batch > 0 else [])]


def drain(layout: Layout, stage: int, last_batch: int, *, final: bool = False, flag: bool = False) -> list[S.Action]:
    """The drain after step ``last_batch`` (-1: no step since the last drain): what is in flight finished, what the
    update deferred settled, the loss not yet taken taken; ``final`` and ``flag``: the run's last agreement read."""
    batch = max(last_batch, 0)
    end = [S.Action(S.LAST_FLAG, batch)] if final and flag else []
    if layout.mode.flushes or last_batch < 0:
        return [S.Action(S.SETTLE, batch), S.Action(S.RESTART, batch), *end]
    return [
        *S.drain(layout, stage, last_batch),
        S.Action(S.DRAINED, batch),
        S.Action(S.SETTLE, batch),
        S.Action(S.TAKE_LOSS, batch),
        S.Action(S.RESTART, batch),
        *end,
    ]


def setup(width: int, tied: int) -> list[S.Action]:
    """A stage's setup, before its first step: with ``width`` replicas, every replica takes replica 0's weights
    (``SETUP_REPLICAS``); each of the ``tied`` parameters the stage shares with another stage is made equal on its
    holders (``SETUP_TIED(b)``, ``b`` its index among them)."""
    return [S.Action(S.SETUP_REPLICAS, 0)] * (width > 1) + [S.Action(S.SETUP_TIED, index) for index in range(tied)]


def rank_program(layout: Layout, stage: int, scenario: Scenario) -> list[S.Action]:
    """Everything ``stage`` runs over ``scenario``: its steps, the drains after them and the run's last drain."""
    actions: list[S.Action] = []
    in_run = 0  # steps since the last drain
    for step in range(scenario.steps):
        synchronous = scenario.synchronous(layout, step)
        actions += train_step(layout, stage, in_run, synchronous=synchronous, flag=scenario.flag)
        in_run = 0 if layout.mode.flushes or synchronous else in_run + 1
        if step + 1 in scenario.drain_after:
            actions += drain(layout, stage, in_run - 1)
            in_run = 0
    return actions + drain(layout, stage, in_run - 1, final=True, flag=scenario.flag)


def programs(layout: Layout, scenario: Scenario | int) -> dict[int, list[S.Action]]:
    """Each stage's program over ``scenario`` (an int: that many steps and the run's drain)."""
    scenario = Scenario(steps=scenario) if isinstance(scenario, int) else scenario
    return {stage: rank_program(layout, stage, scenario) for stage in range(layout.num_stages)}


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
    parser.add_argument("--sync-steps", type=int, default=0, help="2BW's synchronous start: its first steps drained")
    parser.add_argument("--drain-after", type=int, nargs="*", default=(), help="steps (1-based) followed by a drain")
    parser.add_argument("--flag", action="store_true", help="the strategy's stop agreement at each step's head")
    args = parser.parse_args()
    scenario = Scenario(args.steps, args.sync_steps, tuple(args.drain_after), args.flag)
    print(dump(programs(Layout(args.stages, args.microbatches, args.mode), scenario)), end="")


if __name__ == "__main__":
    main()
