"""The communication program each rank of a pipeline issues, lowered from the schedules' action lists.

``programs(layout)`` walks the real action lists (``schedule.segment`` / ``schedule.drain``) of every
stage and replica and emits, for each action (the update's parts included: REDUCE, CHECK, HOOKS, CLIP, TIED_STEP),
the calls the transport (``comm.py``) and the update (``update.py``, ``gradients.py``) make, in the engine's order: the per-step SIGTERM flag and loss
broadcast, drains, evaluation. ``nccl_model.simulate`` then decides whether the layout can deadlock
under NCCL. The distributed tests record the calls of real runs and check that this lowering issues
the same ones on the pipeline's own process groups, so the model cannot drift from the code.

``transport="batched"`` (the default) is ``comm.StageLink``: one group per stage pair, each send in one batch with
the receive fused to it. The transports this project had before stay here as lowerings, so the model can show
why they were replaced: ``"directional"`` (one group per direction, receives posted early, sends retired two
segments later) deadlocks once kernels of different communicators run one at a time, and keeps O(m) messages;
``"shared"`` (every message of a stage pair on the default group, one header per microbatch) deadlocks even
when communicators progress independently.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import schedule as S
from .nccl_model import COLLECTIVE, RECV, SEND, WAIT, Op, Programs


@dataclass(frozen=True)
class CommLayout:
    mode: str
    num_stages: int
    num_microbatches: int
    data_parallel_size: int = 1
    steps: int = 3
    clip: str | None = None  # None, "global" (an all-reduce of the norm over the pipeline) or "stage"
    tied: bool = False  # a parameter shared by the first and the last stage (GPT's tied embedding)
    skip_nonfinite: bool = False  # on_nonfinite="skip": an all-reduce over the pipeline per update
    drain_after: tuple[int, ...] = ()  # Lightning steps after which the pipeline drains (validation, checkpoint)
    eval_batches: int = 0  # validation batches run after each of those drains
    boundary_tensors: int = 1  # tensors crossing each stage boundary
    gradient_buckets: int = 1  # replica all-reduce buckets per update
    transport: str = "batched"  # comm.StageLink; "directional" and "shared": the transports it replaced
    lookahead: int = 0  # more forwards in flight before the last stage (schedule.warmup_forwards)


class _Rank:
    """One rank's program and the transport/strategy state that decides which calls it makes."""

    def __init__(self, layout: CommLayout, replica: int, stage: int) -> None:
        self.layout, self.replica, self.stage = layout, replica, stage
        d = layout.num_stages
        self.rank = replica * d + stage
        self.world = tuple(range(d * layout.data_parallel_size))
        self.pipeline = tuple(replica * d + s for s in range(d))
        self.ops: list[Op] = []
        self.handles = 0
        self.pending_sends: list[tuple[int, int]] = []  # legacy transports: (handle, segment)
        self.segment = 0
        self.batches = 0
        self.unsettled: dict[int, list[list[int]]] = {}  # peer -> batches (their handles) not known complete
        self.fused: dict[str, list[tuple[list[int], list[int]]]] = {"forward": [], "backward": []}
        self.headers: set[tuple[str, str]] = set()  # (direction, phase) whose shapes were exchanged
        self.losses: dict[int, int] = {}
        self.deferred: dict[int, list[int]] = {}
        self.backwards: dict[int, int] = {}  # batch -> backwards run (the last one starts the bucket all-reduces)
        self.bucket_handles: dict[int, list[int]] = {}
        self.posted: dict[str, list[list[int]]] = {"forward": [], "backward": []}  # legacy: receives posted early
        self.waited: set[int] = set()
        self.stashed: set[int] = set()  # microbatches forwarded here and not yet backwarded
        self.sigterm: int | None = None
        self.step_in_run = 0

    # -------------------------------------------------------------- primitives
    def issue(
        self, kind: str, channel: str, label: str, peer: int = -1, members: tuple[int, ...] = (), batch: int = -1
    ) -> int:
        handle = self.handles
        self.handles += 1
        name = label.split(":")[0] if kind == COLLECTIVE else ""
        self.ops.append(Op(kind, handle, channel, peer, members, name, label, batch=batch))
        return handle

    def wait(self, handle: int, label: str = "") -> None:
        self.ops.append(Op(WAIT, handle, label=label))

    def collective(self, name: str, channel: str, members: tuple[int, ...], label: str, block: bool = True) -> int:
        handle = self.issue(COLLECTIVE, channel, f"{name}: {label}", members=members)
        if block:
            self.wait(handle, label)
        return handle

    # -------------------------------------------------------------- transport (comm.StageLink)
    @property
    def legacy(self) -> bool:
        return self.layout.transport != "batched"

    def _pair_channel(self, peer: int) -> str:
        low = min(self.rank, peer) - self.replica * self.layout.num_stages
        return f"pd2bw/p2p/replica{self.replica}/stage{low}-{low + 1}"

    def batch(self, peer: int, sends: list[str], receives: int, label: str) -> tuple[list[int], list[int]]:
        """StageLink._issue: one batch_isend_irecv; a batch with sends is held until settled."""
        if not sends and not receives:
            return [], []
        self.batches += 1
        channel, batch = self._pair_channel(peer), self.batches
        sent = [self.issue(SEND, channel, what, peer, batch=batch) for what in sends]
        received = [self.issue(RECV, channel, label, peer, batch=batch) for _ in range(receives)]
        if sent:
            self.unsettled.setdefault(peer, []).append(sent + received)
        return sent, received

    def wait_all(self, handles: list[int], label: str) -> None:
        for handle in handles:
            if handle not in self.waited:
                self.waited.add(handle)
                self.wait(handle, label)

    def settle(self, peer: int, keep: int = 0, label: str = "settle sends") -> None:
        batches = self.unsettled.get(peer, [])
        while len(batches) > keep:
            self.wait_all(batches.pop(0), label)

    def receive(self, peer: int, label: str) -> None:
        sent, received = self.batch(peer, [], self.layout.boundary_tensors, label)
        self.wait_all(received, label)
        self.settle(peer)

    def use(self, direction: str, peer: int, label: str) -> None:
        sent, received = self.fused[direction].pop(0)
        self.wait_all(sent + received, label)
        self.settle(peer)

    def send_forward(self, phase: str, label: str, fused: S.Action | None = None) -> None:
        if self.legacy:
            return self.legacy_send_forward(phase, label)
        sends = [label] * self.layout.boundary_tensors
        if ("out", phase) not in self.headers:
            self.headers.add(("out", phase))
            sends = [f"{label} header"] + sends
        receives = self.layout.boundary_tensors if fused is not None else 0
        handles = self.batch(self.rank + 1, sends, receives, f"{fused} fused with {label}")
        if fused is not None:
            self.fused["backward"].append(handles)

    def recv_forward(self, phase: str, label: str) -> None:
        if self.legacy:
            return self.legacy_recv_forward(phase, label)
        if self.fused["forward"]:
            return self.use("forward", self.rank - 1, label)
        if ("in", phase) not in self.headers:
            self.headers.add(("in", phase))
            sent, received = self.batch(self.rank - 1, [], 1, f"{label} header")
            self.wait_all(received, label)
            self.settle(self.rank - 1)
        self.receive(self.rank - 1, label)

    def send_backward(self, label: str, fused: S.Action | None = None) -> None:
        if self.legacy:
            return self.legacy_send_backward(label)
        fuse = fused is not None and ("in", "train") in self.headers
        receives = self.layout.boundary_tensors if fuse else 0
        handles = self.batch(self.rank - 1, [label] * self.layout.boundary_tensors, receives, f"{fused} fused")
        if fuse:
            self.fused["forward"].append(handles)

    def recv_backward(self, label: str) -> None:
        if self.legacy:
            return self.legacy_recv_backward(label)
        if self.fused["backward"]:
            return self.use("backward", self.rank + 1, label)
        self.receive(self.rank + 1, label)

    def wait_sends(self) -> None:
        if self.legacy:
            return self.legacy_wait_sends()
        for peer in list(self.unsettled):
            self.settle(peer, label="wait_sends")

    # -------------------------------------------------------------- the replaced transports
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

    # -------------------------------------------------------------- the update (update.py)
    def _shared(self) -> bool:
        return self.layout.tied and self.layout.num_stages > 1 and self.stage in (0, self.layout.num_stages - 1)

    def defers_tied(self) -> bool:
        """``UpdateRule.defers_tied_sums`` for this rank: the schedules' ``defer_tied``."""
        layout = self.layout
        return layout.mode == "2bw" and self._shared() and not layout.clip and not layout.skip_nonfinite

    def _replicas(self) -> tuple[str, tuple[int, ...]]:
        layout = self.layout
        replicas = tuple(r * layout.num_stages + self.stage for r in range(layout.data_parallel_size))
        return f"pd2bw/replica/stage{self.stage}", replicas

    def backward(self, batch: int) -> None:
        """The batch's last backward on this stage starts the replica all-reduce of each gradient bucket
        (``grad_buckets.py``); REDUCE waits for them."""
        done = self.backwards.pop(batch, 0) + 1
        if done < self.layout.num_microbatches:
            self.backwards[batch] = done
        elif self.layout.data_parallel_size > 1:
            channel, replicas = self._replicas()
            label = f"B(b{batch}) replica average"
            self.bucket_handles[batch] = [
                self.collective("all_reduce", channel, replicas, label, block=False)
                for _ in range(self.layout.gradient_buckets)
            ]

    def reduce(self, batch: int, deferred: bool) -> None:
        layout, label = self.layout, f"REDUCE(b{batch})"
        if layout.data_parallel_size > 1:
            for handle in self.bucket_handles.pop(batch):
                self.wait(handle, label)
            if self._shared():  # the tied parameters are averaged apart from the buckets
                channel, replicas = self._replicas()
                self.collective("all_reduce", channel, replicas, f"{label} replica average of tied parameters")
        if self._shared():
            channel = f"pd2bw/shared/replica{self.replica}/stages0-{layout.num_stages - 1}"
            members = (self.pipeline[0], self.pipeline[-1])
            handle = self.collective("all_reduce", channel, members, f"{label} tied sum", block=not deferred)
            if deferred:
                self.deferred[batch] = [handle]

    def run(self, actions: list[S.Action]) -> None:
        if self.legacy:
            self.legacy_begin_segment()
            self.legacy_post_receives(actions, None)
        pipeline = f"pd2bw/pipeline/replica{self.replica}"
        for index, action in enumerate(actions):
            label = str(action)
            if action.kind == S.FORWARD:
                self.stashed.add(action.microbatch)
            elif action.kind == S.RECV_FORWARD:
                self.recv_forward("train", label)
            elif action.kind == S.SEND_FORWARD:
                self.send_forward("train", label, S.fused_receive(actions, index))
            elif action.kind == S.RECV_BACKWARD:
                self.recv_backward(label)
            elif action.kind == S.BACKWARD:
                self.stashed.discard(action.microbatch)
                self.backward(action.batch)
            elif action.kind == S.SEND_BACKWARD:
                self.send_backward(label, S.fused_receive(actions, index))
            elif action.kind in (S.REDUCE, S.REDUCE_DEFER):
                self.reduce(action.batch, deferred=action.kind == S.REDUCE_DEFER)
            elif action.kind == S.CHECK and self.layout.skip_nonfinite:
                self.collective("all_reduce", pipeline, self.pipeline, f"{label} non-finite agreement")
            elif action.kind == S.CLIP and self.layout.clip == "global":
                self.collective("all_reduce", pipeline, self.pipeline, f"{label} clip norm")
            elif action.kind == S.TIED_STEP:
                for handle in self.deferred.pop(action.batch):
                    self.wait(handle, f"deferred tied sum of b{action.batch}")
            elif action.kind == S.WAIT_SENDS:
                self.wait_sends()
            elif action.kind == S.LOSS:
                loss_group = f"pd2bw/loss/replica{self.replica}"
                self.losses[action.batch] = self.collective(
                    "broadcast", loss_group, self.pipeline, f"loss of b{action.batch}", block=False
                )
            if action.kind in S.RECEIVES and self.legacy:
                self.legacy_post_receives(actions, index)

    # -------------------------------------------------------------- the strategy's step, drain, evaluation
    def take_loss(self, batch: int) -> None:
        if batch in self.losses:
            self.wait(self.losses.pop(batch), f"loss of b{batch}")

    def training_step(self) -> None:
        layout = self.layout
        if self.sigterm is not None:  # the SIGTERM agreement, asynchronous (lightning/preemption.py)
            self.wait(self.sigterm, "sigterm flag")
        self.sigterm = self.collective("all_reduce", "default_pg", self.world, "sigterm flag", block=False)
        step = self.step_in_run
        self.run(
            S.segment(
                layout.mode,
                self.stage,
                layout.num_stages,
                layout.num_microbatches,
                step,
                self.defers_tied(),
                layout.lookahead,
            )
        )
        if layout.mode == "2bw":
            self.step_in_run += 1
            self.take_loss(step - 1)
        else:
            self.wait_sends()
            self.take_loss(step)

    def drain(self) -> None:
        layout = self.layout
        if layout.mode == "2bw" and self.step_in_run > 0:
            last = self.step_in_run - 1
            self.run(
                S.drain(
                    layout.mode,
                    self.stage,
                    layout.num_stages,
                    layout.num_microbatches,
                    last,
                    self.defers_tied(),
                    layout.lookahead,
                )
            )
            self.wait_sends()
        self.backwards.clear()
        for batch in sorted(self.losses):
            self.take_loss(batch)
        self.step_in_run = 0

    def evaluate(self) -> None:
        layout = self.layout
        for batch in range(layout.eval_batches):
            for micro in range(layout.num_microbatches):
                label = f"EVAL(b{batch},m{micro})"
                if self.stage > 0:
                    self.recv_forward("eval", label)
                if self.stage < layout.num_stages - 1:
                    self.send_forward("eval", label)
                    if not self.legacy:
                        self.settle(self.rank + 1, keep=1, label="eval send")
            self.wait_sends()
            pipeline = f"pd2bw/pipeline/replica{self.replica}"
            for part in ("size", "data"):  # broadcast_object_list of the last stage's metrics
                self.collective("broadcast", pipeline, self.pipeline, f"eval results {part}")
        if layout.eval_batches:
            self.collective("all_reduce", "default_pg", self.world, "val metrics (sync_dist)")


def _receives_to_post(actions: list[S.Action], index: int | None) -> list[S.Action]:
    """The directional transport's early receives: the next receive of a direction once the previous completed."""
    kinds = S.RECEIVES if index is None else (actions[index].kind,)
    start = 0 if index is None else index + 1
    found = []
    for kind in kinds:
        found += [a for a in actions[start:] if a.kind == kind][:1]
    return found


def programs(layout: CommLayout) -> Programs:
    """Every rank's communication program for ``layout.steps`` training steps, drains and evaluations."""
    S.validate(layout.mode, layout.num_stages, layout.num_microbatches, layout.lookahead)
    ranks = [_Rank(layout, r, s) for r in range(layout.data_parallel_size) for s in range(layout.num_stages)]
    for rank in ranks:
        if layout.data_parallel_size > 1:  # setup: every replica of a stage starts from replica 0's weights
            replicas = tuple(r * layout.num_stages + rank.stage for r in range(layout.data_parallel_size))
            rank.collective("broadcast", f"pd2bw/replica/stage{rank.stage}", replicas, "stage weights at setup")
        if rank._shared():  # setup: the first stage holding a tied parameter broadcasts it
            members = (rank.pipeline[0], rank.pipeline[-1])
            channel = f"pd2bw/shared/replica{rank.replica}/stages0-{layout.num_stages - 1}"
            rank.collective("broadcast", channel, members, "tied parameter at setup")
        for step in range(1, layout.steps + 1):
            rank.training_step()
            if step in layout.drain_after:  # validation (or a checkpoint): drain first
                rank.drain()
                rank.evaluate()
        rank.drain()  # on_train_end
        if rank.sigterm is not None:  # and settles the last SIGTERM flag
            rank.wait(rank.sigterm, "sigterm flag")
    return {rank.rank: rank.ops for rank in ranks}
