"""The ring's transport lowered (interleaved 1F1B: ``StageLink.stage_send`` / ``stage_receive`` / ``exchange``): each
message of a tick staged, ``TICK`` issuing the staged headers (a boundary's first message in a phase) in one batch,
waited for, and the messages in another, waited for before the compute that reads them, on the replica's ring group
(``schedules/lockstep.py`` says why this order cannot deadlock; ``nccl_model`` checks it). ``comm_plan.RankProgram``
holds one where its stage holds several chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..schedules import schedule as S
from .nccl_model import RECV, SEND


class RingLowering:
    """One rank's ring messages, lowered into ``program`` (a ``comm_plan.RankProgram``: ``issue``, ``wait_all``)."""

    def __init__(self, program: Any, channel: str, previous: int, following: int, tensors: int) -> None:
        self.program, self.channel, self.tensors = program, channel, tensors
        self.previous, self.next = previous, following
        d, stage = program.layout.num_stages, program.stage
        self.boundary = lambda action, received: action.chunk * d + stage - int(received)  # the virtual boundary
        self.staged: list[tuple[str, int, bool, S.Action]] = []  # (kind, peer, needs a header, action)
        self.headers: set[tuple[str, str, int]] = set()  # (direction, phase, boundary) whose shapes travelled
        self.ticks: list[list[int]] = []  # the batches not yet waited for, in issue order
        self.arriving: dict[tuple[bool, int, int], list[int]] = {}  # (gradient?, chunk, microbatch) -> its batch

    def _header(self, kind: str, phase: str, action: S.Action) -> bool:
        key = (kind, phase, self.boundary(action, kind == RECV))
        new = key not in self.headers
        self.headers.add(key)
        return new

    def handlers(
        self, phase: str, computes: dict[S.Kind, Callable[[S.Action], None]]
    ) -> dict[S.Kind, Callable[[S.Action], None]]:
        """The transport's handlers of ``phase`` ("train" or "eval"), as ``interleaving.lockstep_handlers``', and
        ``computes`` (FORWARD, BACKWARD or EVAL) each waiting first for the tick that received its input."""

        def stage(kind: str, peer: int, header: bool) -> Callable[[S.Action], None]:
            return lambda a: self.staged.append((kind, peer, header and self._header(kind, phase, a), a))

        def arrives(compute: Callable[[S.Action], None]) -> Callable[[S.Action], None]:
            return lambda a: (self.arrive(a), compute(a))

        return {
            S.RECV_FORWARD: stage(RECV, self.previous, True),
            S.SEND_FORWARD: stage(SEND, self.next, True),
            S.RECV_BACKWARD: stage(RECV, self.next, False),
            S.SEND_BACKWARD: stage(SEND, self.previous, False),
            S.TICK: lambda a: self.tick(),
            **{kind: arrives(compute) for kind, compute in computes.items()},
        }

    def tick(self) -> None:
        """``StageLink.exchange``: the headers' batch waited for, the messages' batch issued."""
        staged, self.staged = self.staged, []
        headers = [(kind, peer, f"{a} header") for kind, peer, header, a in staged if header]
        if headers:
            self.program.wait_all(self._batch(headers), "tick headers")
        handles = self._batch([(kind, peer, str(a)) for kind, peer, _, a in staged for _ in range(self.tensors)])
        self.ticks.append(handles)
        for kind, _, _, a in staged:
            if kind == RECV:
                self.arriving[(a.kind == S.RECV_BACKWARD, a.chunk, a.microbatch)] = handles

    def arrive(self, compute: S.Action) -> None:
        """``StageLink.arrived``: the batch that received ``compute``'s input waited for, with every earlier one."""
        handles = self.arriving.pop((compute.kind == S.BACKWARD, compute.chunk, compute.microbatch), None)
        while handles is not None and self.ticks and handles in self.ticks:
            self.program.wait_all(self.ticks.pop(0), "arrived")

    def wait_sends(self) -> None:
        while self.ticks:
            self.program.wait_all(self.ticks.pop(0), "wait_sends")

    def _batch(self, messages: list[tuple[str, int, str]]) -> list[int]:
        if not messages:
            return []
        self.program.batches += 1
        ordered = sorted(messages, key=lambda message: message[0] != SEND)  # sends first, as the transport
        return [
            self.program.issue(kind, self.channel, label, peer, batch=self.program.batches)
            for kind, peer, label in ordered
        ]
