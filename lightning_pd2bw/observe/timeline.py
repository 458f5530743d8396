"""Pipeline timelines: what each stage ran and when, its bubble fraction, and a Chrome/Perfetto trace.

Recording is switched on by giving the executor a ``Recorder``; it then notes every action of the schedule
(forward, backward, send, receive, the update's parts: REDUCE, CHECK, HOOKS, CLIP, STEP, and a drain's
WAIT_SENDS) with its start and end: the timeline's vocabulary is the schedule's.
Times are seconds since the recorder's ``origin``; stages that take their origin right after a
barrier share a clock to within the barrier's skew (a few microseconds on one host).

The **bubble fraction** of a stage over a window is the share of the window in which it computed
nothing: ``1 - (forward + backward + optimizer time) / window``. Receives (blocked on a neighbour),
the update's collectives and the framework's time between steps all count as bubble, which is what a
user pays for.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..engine.schedules import schedule as S

COMPUTE = (S.FORWARD, S.BACKWARD, S.WEIGHT, S.STEP)  # the rest (transport, reductions, clipping) is bubble


@dataclass(frozen=True)
class Event:
    """One action's span on one stage: ``kind`` is its ``schedule.Kind``."""

    kind: str
    batch: int
    microbatch: int
    version: int
    start: float
    end: float
    chunk: int = 0  # interleaved 1F1B: which of the stage's chunks ran it

    @property
    def seconds(self) -> float:
        return self.end - self.start


class Recorder:
    """Collects a stage's events; ``take()`` hands them over and starts afresh.

    On a CUDA device the work is asynchronous: a stamp is a CUDA event recorded on the current stream (no
    synchronisation per action); stamps are turned into seconds when ``take()`` or ``clock()`` is called,
    which waits once for the last of them. On the CPU a stamp is the host clock."""

    def __init__(self, origin: float | None = None, device: torch.device | None = None) -> None:
        self.origin = time.perf_counter() if origin is None else origin
        self.device = device
        self.events: list[Event] = []
        self._cuda = device is not None and device.type == "cuda"
        self._pending: list[tuple[str, int, int, int, Any, Any]] = []
        if self._cuda:
            torch.cuda.synchronize(device)  # the device is idle: its first event is at the host's time
            self._origin_event = self._event()
            self._origin_seconds = time.perf_counter() - self.origin

    def _event(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def now(self) -> Any:
        """A stamp: seconds since the origin (CPU), or a CUDA event on the stream (resolved by ``take``)."""
        return self._event() if self._cuda else time.perf_counter() - self.origin

    def clock(self) -> float:
        """Seconds since the origin once the device has run what is queued (on CUDA: one wait)."""
        if not self._cuda:
            return self.now()
        stamp = self._event()
        stamp.synchronize()
        return self._seconds(stamp)

    def _seconds(self, stamp: Any) -> float:
        return stamp if not self._cuda else self._origin_seconds + self._origin_event.elapsed_time(stamp) / 1e3

    def add(self, kind: str, batch: int, microbatch: int, version: int, start: Any, chunk: int = 0) -> None:
        """Record a span that began at ``start`` (``self.now()`` then) and ends now."""
        self._pending.append((kind, batch, microbatch, version, start, self.now(), chunk))
        if not self._cuda:
            self._resolve()

    def _resolve(self) -> None:
        if self._cuda and self._pending:
            self._pending[-1][5].synchronize()
        for kind, batch, microbatch, version, start, end, chunk in self._pending:
            self.events.append(Event(kind, batch, microbatch, version, self._seconds(start), self._seconds(end), chunk))
        self._pending.clear()

    def action(self, action: S.Action, start: Any) -> None:
        self.add(action.kind, action.batch, action.microbatch, action.weight_version, start, action.chunk)

    @contextmanager
    def span(self, kind: str, batch: int = -1) -> Iterator[None]:
        start = self.now()
        yield
        self.add(kind, batch, -1, -1, start)

    def take(self) -> list[Event]:
        self._resolve()
        events, self.events = self.events, []
        return events


def busy_seconds(events: Iterable[Event], start: float = float("-inf"), end: float = float("inf")) -> float:
    """Compute time inside [start, end]: forwards, backwards and optimizer steps (the update's reductions, checks
    and clipping are actions of their own, counted as bubble)."""
    total = 0.0
    for event in events:
        if event.kind in COMPUTE:
            total += max(0.0, min(event.end, end) - max(event.start, start))
    return total


def bubble_fraction(events: Sequence[Event], start: float, end: float) -> float:
    """Share of [start, end] in which the stage computed nothing."""
    if end <= start:
        raise ValueError(f"empty window [{start}, {end}]")
    return 1.0 - busy_seconds(events, start, end) / (end - start)


@dataclass
class StageTimeline:
    """One rank's events with its place in the grid; what ranks send to be merged."""

    rank: int
    stage: int
    replica: int
    events: list[Event]

    def to_dict(self) -> dict:
        return {
            "rank": self.rank,
            "stage": self.stage,
            "replica": self.replica,
            "events": [asdict(e) for e in self.events],
        }

    @classmethod
    def from_dict(cls, data: dict) -> StageTimeline:
        return cls(data["rank"], data["stage"], data["replica"], [Event(**e) for e in data["events"]])


def _label(event: Event) -> str:
    if event.kind in S.BATCH_KINDS:
        return f"{event.kind} b{event.batch}"
    if event.microbatch < 0:
        return event.kind
    return f"{event.kind} b{event.batch} m{event.microbatch}" + (f" c{event.chunk}" if event.chunk else "")


def chrome_trace(timelines: Sequence[StageTimeline]) -> dict:
    """Chrome trace-event JSON (chrome://tracing, ui.perfetto.dev): one process per stage, one
    thread per replica, complete ("X") events in microseconds."""
    events: list[dict] = []
    for stage in sorted({t.stage for t in timelines}):
        events.append({"name": "process_name", "ph": "M", "pid": stage, "args": {"name": f"stage {stage}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": stage, "args": {"sort_index": stage}})
    for timeline in timelines:
        events.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": timeline.stage,
                "tid": timeline.replica,
                "args": {"name": f"replica {timeline.replica} (rank {timeline.rank})"},
            }
        )
        for event in timeline.events:
            events.append(
                {
                    "name": _label(event),
                    "cat": event.kind,
                    "ph": "X",
                    "pid": timeline.stage,
                    "tid": timeline.replica,
                    "ts": event.start * 1e6,
                    "dur": event.seconds * 1e6,
                    "args": {
                        "batch": event.batch,
                        "microbatch": event.microbatch,
                        "weight_version": event.version,
                        "chunk": event.chunk,
                    },
                }
            )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str | Path, timelines: Sequence[StageTimeline]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(timelines)))
    return path
