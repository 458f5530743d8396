"""The transports this project had before ``transport.StageLink``, kept beside the tests as lowerings (subclasses of
``comm_plan.RankProgram``) so that ``nccl_model`` can show why they were replaced: ``replaced_programs(layout, name)``.

- ``"directional"``: one group per direction, receives posted early, sends retired two segments later. Free of
  deadlock while communicators progress independently; a hang once kernels of different communicators run one at
  a time; O(m) messages held.
- ``"shared"``: every message of a stage pair on the default group, one header per microbatch. A hang even when
  communicators progress independently.
"""

from __future__ import annotations

from lightning_pd2bw.engine.schedules import schedule as S
from lightning_pd2bw.engine.verify.comm_plan import CommLayout, RankProgram, programs
from lightning_pd2bw.engine.verify.nccl_model import RECV, SEND, Programs

TRANSPORTS = ("directional", "shared")


def replaced_programs(layout: CommLayout, transport: str) -> Programs:
    """``comm_plan.programs`` with one of the replaced transports lowered instead of ``StageLink``."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r}: the replaced transports are {TRANSPORTS}")
    return programs(layout, type(f"{transport.title()}Rank", (ReplacedRank,), {"transport": transport}))


class ReplacedRank(RankProgram):
    """A rank whose transport calls are those of a replaced transport (``transport``, set by ``replaced_programs``)."""

    transport = "directional"

    def __init__(self, layout: CommLayout, replica: int, stage: int) -> None:
        super().__init__(layout, replica, stage)
        self.pending_sends: list[tuple[int, int]] = []  # (handle, segment)
        self.segment = 0
        self.posted: dict[str, list[list[int]]] = {"forward": [], "backward": []}  # receives posted early

    def channel_of(self, direction: str, low_stage: int) -> str:
        if self.transport == "shared":
            return "default_pg"
        r = self.replica
        if direction == "activations":
            return f"pd2bw/activations/replica{r}/stage{low_stage}->{low_stage + 1}"
        return f"pd2bw/gradients/replica{r}/stage{low_stage + 1}->{low_stage}"

    def send_forward(self, phase: str, label: str, fused: S.Action | None = None) -> None:
        channel, peer = self.channel_of("activations", self.stage), self.rank + 1
        if self.transport == "shared" or ("out", phase) not in self.headers:
            self.headers.add(("out", phase))
            self.pending_sends.append((self.issue(SEND, channel, f"{label} header", peer), self.segment))
        for _ in range(self.layout.boundary_tensors):
            self.pending_sends.append((self.issue(SEND, channel, label, peer), self.segment))

    def recv_forward(self, phase: str, label: str) -> None:
        channel, peer = self.channel_of("activations", self.stage - 1), self.rank - 1
        if self.posted["forward"]:
            for handle in self.posted["forward"].pop(0):
                self.wait(handle, label)
            return
        if self.transport == "shared" or ("in", phase) not in self.headers:
            self.headers.add(("in", phase))
            self.wait(self.issue(RECV, channel, f"{label} header", peer), label)
        for handle in [self.issue(RECV, channel, label, peer) for _ in range(self.layout.boundary_tensors)]:
            self.wait(handle, label)

    def send_backward(self, label: str, fused: S.Action | None = None) -> None:
        channel = self.channel_of("gradients", self.stage - 1)
        for _ in range(self.layout.boundary_tensors):
            self.pending_sends.append((self.issue(SEND, channel, label, self.rank - 1), self.segment))

    def recv_backward(self, label: str) -> None:
        channel = self.channel_of("gradients", self.stage)
        if self.posted["backward"]:
            for handle in self.posted["backward"].pop(0):
                self.wait(handle, label)
            return
        for handle in [self.issue(RECV, channel, label, self.rank + 1) for _ in range(self.layout.boundary_tensors)]:
            self.wait(handle, label)

    def post_receives(self, actions: list[S.Action], index: int | None) -> None:
        """StageExecutor._post_receives: the next receive of a direction, posted early once its shapes are known."""
        if self.transport == "shared":  # the old transport posted each receive where it was used
            return
        for action in _receives_to_post(actions, index):
            label = f"{action} posted early"
            if action.kind == S.RECV_FORWARD and ("in", "train") in self.headers:
                channel, peer = self.channel_of("activations", self.stage - 1), self.rank - 1
            elif action.kind == S.RECV_BACKWARD and action.microbatch in self.stashed:
                channel, peer = self.channel_of("gradients", self.stage), self.rank + 1
            else:
                continue
            direction = "forward" if action.kind == S.RECV_FORWARD else "backward"
            handles = [self.issue(RECV, channel, label, peer) for _ in range(self.layout.boundary_tensors)]
            self.posted[direction].append(handles)

    def wait_sends(self) -> None:
        for handle, _ in self.pending_sends:
            self.wait(handle, "wait_sends")
        self.pending_sends.clear()

    def after_receive(self, actions: list[S.Action], index: int) -> None:
        self.post_receives(actions, index)

    def after_eval_send(self) -> None:
        """The replaced transports held evaluation sends until ``wait_sends``."""

    def before_segment(self, actions: list[S.Action]) -> None:
        """The old ``begin_segment``: the sends of two segments ago are waited for; the first receives posted."""
        self.segment += 1
        for handle, segment in self.pending_sends:
            if segment <= self.segment - 2:
                self.wait(handle, "retire sends")
        self.pending_sends = [(h, s) for h, s in self.pending_sends if s > self.segment - 2]
        self.post_receives(actions, None)


def _receives_to_post(actions: list[S.Action], index: int | None) -> list[S.Action]:
    """The directional transport's early receives: the next receive of a direction once the previous completed."""
    kinds = S.RECEIVES if index is None else (actions[index].kind,)
    start = 0 if index is None else index + 1
    found = []
    for kind in kinds:
        found += [a for a in actions[start:] if a.kind == kind][:1]
    return found
