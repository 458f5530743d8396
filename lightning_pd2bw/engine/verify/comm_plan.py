"""The communication program each rank of a pipeline issues, lowered from the schedules' action lists.

``programs(layout)`` walks the real action lists (``schedule.segment`` / ``schedule.drain``) of every
stage and replica and emits, for each action (the update's included: REDUCE, CHECK, HOOKS, NORM, CLIP, STEP),
the calls the transport (``transport.py``) and the update's parts (``update_parts.py``, ``stepper.py``) make, in the
engine's order (sends fused with receives by the executor's own pass, ``schedule.fuse_receives``): the per-step SIGTERM flag and loss
broadcast, drains, evaluation. ``nccl_model.simulate`` then decides whether the layout can deadlock
under NCCL. The distributed tests record the calls of real runs and check that this lowering issues
the same ones on the pipeline's own process groups, so the model cannot drift from the code.

The transport lowered is ``transport.StageLink``: one group per stage pair, each send in one batch with the receive
fused to it. ``RankProgram``'s transport methods (``send_forward`` ... ``wait_sends``, ``before_segment``,
``after_receive``) are where another transport's lowering plugs in: ``programs(layout, rank_type=...)``. The tests
keep the transports this project replaced that way (``tests/replaced_transports.py``) to show why they were replaced.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..comm.grid import STOP_FLAG_GROUP, communicator
from ..layout import Layout, Placement, check_schedule
from ..schedules import program
from ..schedules import schedule as S
from ..schedules.lowering import ISSUE as ISSUE_PART
from ..schedules.lowering import WAIT as WAIT_PART
from ..schedules.lowering import Op as LoweredOp
from ..schedules.lowering import lower
from ..updates import update_build as U
from ..updates.collectives import Collective
from ..updates.update import UpdateShape
from .nccl_model import COLLECTIVE, RECV, SEND, WAIT, Op, Programs
from .ring_plan import RingLowering


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
    sync_steps: int = 0  # 2BW's synchronous start: its first steps drained (program.train_step)
    eval_batches: int = 0  # validation batches run after each of those drains
    boundary_tensors: int = 1  # tensors crossing each stage boundary
    gradient_buckets: int = 1  # replica all-reduce buckets per update
    lookahead: int = 0  # more forwards in flight before the last stage (schedule.warmup_forwards)
    shard_optimizer: bool = True  # width > 1: each owner broadcasts its new weights after STEP (sharding.py)
    shard_gradients: bool = False  # each bucket's owners' parts reduced to them; norm and flag summed over replicas
    meta_init: bool = True  # built on the meta device: the tied weight's holders agree whose copy was initialised
    placement: Placement = Placement.PIPELINE  # which ranks are neighbours (layout.Placement)
    virtual_stages: int | None = None  # interleaved 1F1B's chunks a stage (None: the mode's default)


class RankProgram:
    """One rank's program and the transport/strategy state that decides which calls it makes."""

    def __init__(self, layout: CommLayout, replica: int, stage: int) -> None:
        self.layout, self.replica, self.stage = layout, replica, stage
        d, width = layout.num_stages, layout.data_parallel_size
        self.pipeline = tuple(Placement(layout.placement).rank(s, replica, d, width) for s in range(d))
        self.rank = self.pipeline[stage]
        self.world = tuple(range(d * width))
        self.previous = self.pipeline[stage - 1] if stage > 0 else -1  # the neighbours' ranks
        self.next = self.pipeline[stage + 1] if stage < d - 1 else -1
        self.ops: list[Op] = []
        self.handles = 0
        self.batches = 0
        self.unsettled: dict[int, list[list[int]]] = {}  # peer -> batches (their handles) not known complete
        self.fused: dict[str, list[tuple[list[int], list[int]]]] = {"forward": [], "backward": []}
        self.headers: set[tuple[str, str]] = set()  # (direction, phase) whose shapes were exchanged
        self.losses: dict[int, int] = {}
        self.schedule_layout = Layout(
            d, layout.num_microbatches, layout.mode, lookahead=layout.lookahead, virtual_stages=layout.virtual_stages
        )
        self.ring = None  # interleaved 1F1B: its messages over the ring, one batch a tick (``ring_plan.py``)
        if self.schedule_layout.virtual_stages > 1:
            channel = self.group("ring")[0]
            following, previous = self.pipeline[(stage + 1) % d], self.pipeline[(stage - 1) % d]
            self.ring = RingLowering(self, channel, previous, following, layout.boundary_tensors)
        self.parts = U.collectives(self.update_shape())  # the update's parts and the collectives each declares
        self.inflight: dict[tuple[int, Collective], list[int]] = {}  # (batch, declared) -> handles to wait for
        self.waited: set[int] = set()
        self.stashed: set[int] = set()  # microbatches forwarded here and not yet backwarded
        self.sigterm: int | None = None
        self.step_in_run = 0
        self.steps_run = 0
        self._fused: S.Action | None = None  # the receive the current send's batch also posts
        self.table = self.handlers()

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

    # -------------------------------------------------------------- transport (transport.StageLink)
    def _pair_channel(self, peer: int) -> str:
        low = min(self.pipeline.index(self.rank), self.pipeline.index(peer))  # the pair's first stage
        layout = self.layout
        return communicator(
            "p2p", low, self.replica, layout.num_stages, layout.data_parallel_size, (), layout.placement
        )[0]

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
        sends = [label] * self.layout.boundary_tensors
        if ("out", phase) not in self.headers:
            self.headers.add(("out", phase))
            sends = [f"{label} header"] + sends
        receives = self.layout.boundary_tensors if fused is not None else 0
        handles = self.batch(self.next, sends, receives, f"{fused} fused with {label}")
        if fused is not None:
            self.fused["backward"].append(handles)

    def recv_forward(self, phase: str, label: str) -> None:
        if self.fused["forward"]:
            return self.use("forward", self.previous, label)
        if ("in", phase) not in self.headers:
            self.headers.add(("in", phase))
            sent, received = self.batch(self.previous, [], 1, f"{label} header")
            self.wait_all(received, label)
            self.settle(self.previous)
        self.receive(self.previous, label)

    def send_backward(self, label: str, fused: S.Action | None = None) -> None:
        fuse = fused is not None and ("in", "train") in self.headers
        receives = self.layout.boundary_tensors if fuse else 0
        handles = self.batch(self.previous, [label] * self.layout.boundary_tensors, receives, f"{fused} fused")
        if fuse:
            self.fused["forward"].append(handles)

    def recv_backward(self, label: str) -> None:
        if self.fused["backward"]:
            return self.use("backward", self.next, label)
        self.receive(self.next, label)

    def wait_sends(self) -> None:
        for peer in list(self.unsettled):
            self.settle(peer, label="wait_sends")
        if self.ring is not None:
            self.ring.wait_sends()

    # -------------------------------------------------------------- the update (update_build.py)
    def _shared(self) -> bool:
        return self.layout.tied and self.layout.num_stages > 1 and self.stage in (0, self.layout.num_stages - 1)

    def update_shape(self) -> UpdateShape:
        """This stage's update as ``update_build.build_update`` sees it in a run of this layout."""
        layout = self.layout
        return UpdateShape.of(
            layout.mode,
            layout.data_parallel_size,
            shard_optimizer=layout.shard_optimizer,
            shard_gradients=layout.shard_gradients,
            nonfinite="skip" if layout.skip_nonfinite else "stop",
            clip=layout.clip,
            buckets=layout.gradient_buckets,
            tied=self._shared(),
        )

    def group(self, name: str) -> tuple[str, tuple[int, ...]]:
        """A ``grid.Groups`` communicator of this stage: its channel and members (``grid.communicator``)."""
        layout, d = self.layout, self.layout.num_stages
        return communicator(name, self.stage, self.replica, d, layout.data_parallel_size, (0, d - 1), layout.placement)

    def update(self, op: LoweredOp) -> None:
        """What the update's parts issue and wait for at ``op`` (its lowered steps, ``lowering.Op.steps``: part by
        part in the builder's order, each part's declared collectives in their order)."""
        at, batch = str(op), op.batch
        for step, _, collective in op.steps:
            if collective is None:
                continue
            if step == WAIT_PART:  # (none left: the next batch's first backward reclaimed them)
                for handle in self.inflight.pop((batch, collective), []):
                    self.wait(handle, f"{at} {collective.what}")
            elif step == ISSUE_PART:
                channel, members = self.group(collective.group)
                block = collective.waited is None
                label = f"{at} {collective.what}"
                handles = [
                    self.collective(collective.op, channel, members, label, block=block)
                    for _ in range(collective.repeat)
                ]
                if not block:
                    self.inflight[(batch, collective)] = handles

    # -------------------------------------------------------------- the interpreter (executor.StageExecutor.run)
    def handlers(self) -> dict[S.Kind, Callable[[S.Action], None]]:
        """The lowering's ``{Kind: handler}`` table, built as the engine builds its own: the executor's compute and
        transport handlers, the update's parts (``UpdateRule.handlers``, ``update_build.build_update``) and the loss
        (``PipelineEngine.start``).
        ``tests/unit/test_comm_plan.py`` checks it covers the same kinds as a started engine's table."""
        transport = {
            S.RECV_FORWARD: lambda action: self.recv_forward("train", str(action)),
            S.FORWARD: lambda action: self.stashed.add(action.microbatch),
            S.SEND_FORWARD: lambda action: self.send_forward("train", str(action), self._fused),
            S.RECV_BACKWARD: lambda action: self.recv_backward(str(action)),
            S.BACKWARD: self._backward,
            S.SEND_BACKWARD: lambda action: self.send_backward(str(action), self._fused),
            S.WEIGHT: self._weight,
            S.WAIT_SENDS: lambda action: self.wait_sends(),
        }
        # the before-step hooks at HOOKS: the sparsity callback's collectives are its own steps'
        update = {kind: self.update for kind in S.UPDATE_KINDS}
        step = {
            S.FLAG: self._flag,
            S.LAST_FLAG: self._last_flag,
            S.DRAINED: lambda op: self.wait_sends(),  # the transport's sends complete (the engine's finish_drain)
            S.SETTLE: lambda op: None,  # the update's deferred waits: its declared collectives' own steps
            S.TAKE_LOSS: lambda op: self.take_loss(op.batch),
            S.RESTART: lambda op: None,
        }
        computes = {S.FORWARD: transport[S.FORWARD], S.BACKWARD: self._backward}
        ring = self.ring.handlers("train", computes) if self.ring is not None else {S.TICK: lambda op: None}
        return {**transport, **ring, **update, S.LOSS: self._loss, **step}

    def run(self, actions: list[S.Action]) -> None:
        self.before_segment(actions)
        for op in lower(actions, self.parts, self.layout.num_microbatches):  # the executor's own lowering
            self._fused = op.fused
            self.table[op.kind](op)
            if op.kind in S.RECEIVES:
                self.after_receive(actions, op.index)

    def before_segment(self, actions: list[S.Action]) -> None:
        """A transport's work at the head of a segment (StageLink has none)."""

    def after_receive(self, actions: list[S.Action], index: int) -> None:
        """A transport's work once a receive completes (StageLink has none)."""

    def after_eval_send(self) -> None:
        """StageLink settles an evaluation send once the next one is in flight."""
        self.settle(self.next, keep=1, label="eval send")

    def _backward(self, op: LoweredOp) -> None:
        """A batch's last backward on this stage starts the replica all-reduce of each gradient bucket
        (``grad_buckets.py``); CHECK waits for them."""
        self.stashed.discard(op.microbatch)
        for _, _, collective in op.reclaims:  # the previous batch's, still reading the buffers this one fills
            for handle in self.inflight.pop((op.batch - 1, collective), []):
                self.wait(handle, f"{op} reclaims {collective.what}")
        if op.last:
            self.update(op)

    def _weight(self, op: LoweredOp) -> None:
        """A split backward's W: compute only; the batch's last starts the buckets' reduces (held since its last B)."""
        if op.last:
            self.update(op)

    def _loss(self, action: S.Action) -> None:
        loss_group, _ = self.group("loss")
        self.losses[action.batch] = self.collective(
            "broadcast", loss_group, self.pipeline, f"loss of b{action.batch}", block=False
        )

    # -------------------------------------------------------------- a step's head and end (program.py)
    def take_loss(self, batch: int) -> None:
        if batch in self.losses:
            self.wait(self.losses.pop(batch), f"loss of b{batch}")

    def _flag(self, op: LoweredOp) -> None:
        """FLAG: the stop agreement, asynchronous (lightning/preemption.py): the previous step's waited for."""
        self._last_flag(op)
        self.sigterm = self.collective("all_reduce", STOP_FLAG_GROUP, self.world, "sigterm flag", block=False)

    def _last_flag(self, op: LoweredOp) -> None:
        if self.sigterm is not None:
            self.wait(self.sigterm, "sigterm flag")
            self.sigterm = None

    def training_step(self) -> None:
        layout, step = self.layout, self.steps_run
        synchronous = self.schedule_layout.mode.double_buffered and step < layout.sync_steps
        self.run(
            program.train_step(self.schedule_layout, self.stage, self.step_in_run, synchronous=synchronous, flag=True)
        )
        flushed = self.schedule_layout.mode.flushes or synchronous
        self.step_in_run = 0 if flushed else self.step_in_run + 1
        self.steps_run += 1

    def drain(self, final: bool = False) -> None:
        last = self.step_in_run - 1 if self.schedule_layout.mode.double_buffered else -1
        self.run(program.drain(self.schedule_layout, self.stage, last, final=final, flag=True))
        self.step_in_run = 0

    def setup(self) -> None:
        """The stage's setup (``program.setup``, what ``build.py`` runs): the replicas' broadcast; per tied
        parameter, which holder's copy was initialised (built on the meta device) and its broadcast."""
        for action in program.setup(self.layout.data_parallel_size, int(self._shared())):
            if action.kind == S.SETUP_REPLICAS:
                self.collective("broadcast", *self.group("replica"), "stage weights at setup")
                continue
            channel, members = self.group("tied")
            if self.layout.meta_init:  # build._initialised_copy
                self.collective("all_reduce", channel, members, "tied parameter's initialised copies at setup")
            self.collective("broadcast", channel, members, "tied parameter at setup")

    def eval_results(self) -> None:
        """EVAL_RESULTS: ``broadcast_object_list`` of the last stage's results over the pipeline (size, then data)."""
        pipeline, _ = self.group("pipeline")
        for part in ("size", "data"):
            self.collective("broadcast", pipeline, self.pipeline, f"eval results {part}")

    def evaluate(self) -> None:
        layout, chunks = self.layout, self.schedule_layout.virtual_stages
        label = ""  # the evaluation's batch and microbatch, as the traces name them
        table = {
            S.RECV_FORWARD: lambda action: self.recv_forward("eval", label),
            S.EVAL: lambda action: None,
            S.SEND_FORWARD: lambda action: (self.send_forward("eval", label), self.after_eval_send()),
            S.WAIT_SENDS: lambda action: self.wait_sends(),
            S.EVAL_RESULTS: lambda action: self.eval_results(),
            **(self.ring.handlers("eval", {S.EVAL: lambda action: None}) if self.ring is not None else {}),
        }
        for batch in range(layout.eval_batches):
            for action in S.evaluation(self.stage, layout.num_stages, layout.num_microbatches, chunks):
                label = f"EVAL(b{batch},m{action.microbatch})"
                table[action.kind](action)
        if layout.eval_batches:
            self.collective("all_reduce", "default_pg", self.world, "val metrics (sync_dist)")


def programs(layout: CommLayout, rank_type: type[RankProgram] = RankProgram) -> Programs:
    """Every rank's communication program for ``layout.steps`` training steps, drains and evaluations."""
    check_schedule(layout.mode, layout.num_stages, layout.num_microbatches, lookahead=layout.lookahead)
    ranks = [rank_type(layout, r, s) for r in range(layout.data_parallel_size) for s in range(layout.num_stages)]
    for rank in ranks:
        rank.setup()
        for step in range(1, layout.steps + 1):
            rank.training_step()
            if step in layout.drain_after:  # validation (or a checkpoint): drain first
                rank.drain()
                rank.evaluate()
        rank.drain(final=True)  # on_train_end: and the last stop agreement read
    return {rank.rank: rank.ops for rank in ranks}
