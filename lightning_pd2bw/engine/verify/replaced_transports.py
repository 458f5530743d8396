"""The transports this project had before ``transport.StageLink``, kept as lowerings so that ``nccl_model`` can show why
they were replaced (``comm_plan.CommLayout.transport``):

- ``"directional"``: one group per direction, receives posted early, sends retired two segments later. Free of
  deadlock while communicators progress independently; a hang once kernels of different communicators run one at
  a time; O(m) messages held.
- ``"shared"``: every message of a stage pair on the default group, one header per microbatch. A hang even when
  communicators progress independently.
"""

from __future__ import annotations

from typing import Any

from .. import schedule as S
from .nccl_model import RECV, SEND


class ReplacedTransports:
    """The replaced transports' calls, mixed into ``comm_plan._Rank`` (which owns the program and its state)."""

    layout: Any
    stage: int
    rank: int
    replica: int
    headers: set[tuple[str, str]]
    posted: dict[str, list[list[int]]]
    pending_sends: list[tuple[int, int]]
    segment: int
    stashed: set[int]

    def legacy_channel(self, direction: str, low_stage: int) -> str:
        if self.layout.transport == "shared":
            return "default_pg"
        r = self.replica
        if direction == "activations":
            return f"pd2bw/activations/replica{r}/stage{low_stage}->{low_stage + 1}"
        return f"pd2bw/gradients/replica{r}/stage{low_stage + 1}->{low_stage}"

    def legacy_send_forward(self, phase: str, label: str) -> None:
        channel, peer = self.legacy_channel("activations", self.stage), self.rank + 1
        if self.layout.transport == "shared" or ("out", phase) not in self.headers:
            self.headers.add(("out", phase))
            self.pending_sends.append((self.issue(SEND, channel, f"{label} header", peer), self.segment))
        for _ in range(self.layout.boundary_tensors):
            self.pending_sends.append((self.issue(SEND, channel, label, peer), self.segment))

    def legacy_recv_forward(self, phase: str, label: str) -> None:
        channel, peer = self.legacy_channel("activations", self.stage - 1), self.rank - 1
        if self.posted["forward"]:
            for handle in self.posted["forward"].pop(0):
                self.wait(handle, label)
            return
        if self.layout.transport == "shared" or ("in", phase) not in self.headers:
            self.headers.add(("in", phase))
            self.wait(self.issue(RECV, channel, f"{label} header", peer), label)
        for handle in [self.issue(RECV, channel, label, peer) for _ in range(self.layout.boundary_tensors)]:
            self.wait(handle, label)

    def legacy_send_backward(self, label: str) -> None:
        channel = self.legacy_channel("gradients", self.stage - 1)
        for _ in range(self.layout.boundary_tensors):
            self.pending_sends.append((self.issue(SEND, channel, label, self.rank - 1), self.segment))

    def legacy_recv_backward(self, label: str) -> None:
        channel = self.legacy_channel("gradients", self.stage)
        if self.posted["backward"]:
            for handle in self.posted["backward"].pop(0):
                self.wait(handle, label)
            return
        for handle in [self.issue(RECV, channel, label, self.rank + 1) for _ in range(self.layout.boundary_tensors)]:
            self.wait(handle, label)

    def legacy_post_receives(self, actions: list[S.Action], index: int | None) -> None:
        """StageExecutor._post_receives: the next receive of a direction, posted early once its shapes are known."""
        if self.layout.transport == "shared":  # the old transport posted each receive where it was used
            return
        for action in _receives_to_post(actions, index):
            label = f"{action} posted early"
            if action.kind == S.RECV_FORWARD and ("in", "train") in self.headers:
                channel, peer = self.legacy_channel("activations", self.stage - 1), self.rank - 1
            elif action.kind == S.RECV_BACKWARD and action.microbatch in self.stashed:
                channel, peer = self.legacy_channel("gradients", self.stage), self.rank + 1
            else:
                continue
            direction = "forward" if action.kind == S.RECV_FORWARD else "backward"
            handles = [self.issue(RECV, channel, label, peer) for _ in range(self.layout.boundary_tensors)]
            self.posted[direction].append(handles)

    def legacy_wait_sends(self) -> None:
        for handle, _ in self.pending_sends:
            self.wait(handle, "wait_sends")
        self.pending_sends.clear()

    def legacy_begin_segment(self) -> None:
        """StageLink.begin_segment: the sends of two segments ago are waited for."""
        self.segment += 1
        for handle, segment in self.pending_sends:
            if segment <= self.segment - 2:
                self.wait(handle, "retire sends")
        self.pending_sends = [(h, s) for h, s in self.pending_sends if s > self.segment - 2]


def _receives_to_post(actions: list[S.Action], index: int | None) -> list[S.Action]:
    """The directional transport's early receives: the next receive of a direction once the previous completed."""
    kinds = S.RECEIVES if index is None else (actions[index].kind,)
    start = 0 if index is None else index + 1
    found = []
    for kind in kinds:
        found += [a for a in actions[start:] if a.kind == kind][:1]
    return found
