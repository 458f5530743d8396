"""The schedules' instruction set: what an action is (``Kind``, ``Action``, its text form), the kinds' groups, and
the pass every reader of an action list shares: which receive a send is batched with (``fuse_receives``).
``schedule.py`` generates the lists; ``lowering.py`` lowers them for the executor, the NCCL model and the simulator.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    """What an action does; its text form (``str``, traces, logs) is the value."""

    FORWARD = "F"
    BACKWARD = "B"  # the backward; under a split (``Mode.splits_backward``) its input-gradient part alone
    WEIGHT = "W"  # the split's other part: the microbatch's deferred weight gradients (``engine/weight_grads.py``)
    SEND_FORWARD = "SEND_F"
    RECV_FORWARD = "RECV_F"
    SEND_BACKWARD = "SEND_B"
    RECV_BACKWARD = "RECV_B"
    # the update of batch b, in this order (what each part does: engine/updates/update.py's docstring)
    REDUCE = "REDUCE"  # the update begins: the next weight version writable, the gradients set aside
    CHECK = "CHECK"  # the reductions waited for; the non-finite policy
    HOOKS = "HOOKS"  # the before-step hooks (Lightning: on_before_optimizer_step)
    NORM = "NORM"  # the global clip norm launched over the pipeline
    CLIP = "CLIP"  # clipping
    STEP = "STEP"  # the optimizers' step, the delay correction; the sharded optimizer's broadcasts launched
    PUBLISH = "PUBLISH"  # the new weights in place on every replica: the sharded optimizer's broadcasts waited for
    TICK = "TICK"  # the ring's lockstep (``lockstep.py``): the messages since the last TICK go in one batch, waited
    WAIT_SENDS = "WAIT_SENDS"  # a drain (and every flush batch) waits for its outstanding sends
    LOSS = "LOSS"  # the end of a training step: the batch's mean loss, broadcast from the last stage (asynchronous)
    EVAL = "EVAL"  # evaluation or prediction: one microbatch forward-only, on the newest weights (``evaluation``)
    EVAL_RESULTS = "EVAL_RESULTS"  # an evaluation's results, sent from the last stage to the whole pipeline
    # a stage's setup (``program.setup``): its replicas and its tied parameters' holders start equal
    SETUP_REPLICAS = "SETUP_REPLICAS"  # every replica of the stage takes replica 0's weights and buffers
    SETUP_TIED = "SETUP_TIED"  # tied parameter b: its first holder whose copy was initialised broadcasts it
    # a training step's head and end, and a drain's (``program.py``: what a rank runs around the schedule's actions)
    FLAG = "FLAG"  # the run's stop agreement: the previous step's read, this step's posted (the strategy's, if any)
    LAST_FLAG = "LAST_FLAG"  # the run's end: the last step's agreement read
    DRAINED = "DRAINED"  # nothing in flight: every send complete, the version rule restarts (after WAIT_SENDS)
    SETTLE = "SETTLE"  # a drain: what the update deferred settled (``UpdatePart.at_drain``)
    TAKE_LOSS = "TAKE_LOSS"  # the step's result: batch b's mean loss, its broadcast waited for
    RESTART = "RESTART"  # every batch consumed: the batch numbers restart at 0

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


FORWARD, BACKWARD, WEIGHT, STEP, PUBLISH = Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT, Kind.STEP, Kind.PUBLISH
SEND_FORWARD, RECV_FORWARD = Kind.SEND_FORWARD, Kind.RECV_FORWARD
SEND_BACKWARD, RECV_BACKWARD = Kind.SEND_BACKWARD, Kind.RECV_BACKWARD
REDUCE, CHECK, HOOKS, NORM, CLIP = Kind.REDUCE, Kind.CHECK, Kind.HOOKS, Kind.NORM, Kind.CLIP
WAIT_SENDS, LOSS, EVAL, EVAL_RESULTS, TICK = Kind.WAIT_SENDS, Kind.LOSS, Kind.EVAL, Kind.EVAL_RESULTS, Kind.TICK
FLAG, LAST_FLAG, DRAINED, SETTLE = Kind.FLAG, Kind.LAST_FLAG, Kind.DRAINED, Kind.SETTLE
SETUP_REPLICAS, SETUP_TIED = Kind.SETUP_REPLICAS, Kind.SETUP_TIED
TAKE_LOSS, RESTART = Kind.TAKE_LOSS, Kind.RESTART
UPDATE_PARTS = (REDUCE, CHECK, HOOKS, NORM, CLIP)  # run by the update with STEP; REDUCE also makes a version
PREPARE_PARTS = (CHECK, HOOKS, NORM)  # 2BW: beside batch b + 1, once every stage has reached REDUCE(b)
FINISH_PARTS = (CLIP, STEP)  # the update's completion (2BW: beside batch b + 1 where it has room, ``finish_after``)
UPDATE_KINDS = (*UPDATE_PARTS, STEP, PUBLISH)  # every action of the update (``update.UpdateRule.handlers``)
STEP_KINDS = (FLAG, LAST_FLAG, DRAINED, SETTLE, TAKE_LOSS, RESTART)  # a step's head and end (``program.py``)
SETUP_KINDS = (SETUP_REPLICAS, SETUP_TIED)  # what a stage's setup is made of (``build.py`` runs it)
BATCH_KINDS = (
    *UPDATE_KINDS,
    TICK,
    WAIT_SENDS,
    LOSS,
    *STEP_KINDS,
    EVAL_RESULTS,
    *SETUP_KINDS,
)  # no microbatch, no version
EVAL_KINDS = (
    RECV_FORWARD,
    EVAL,
    SEND_FORWARD,
    TICK,
    WAIT_SENDS,
    EVAL_RESULTS,
)  # what an evaluation's actions are made of
TRAIN_KINDS = tuple(k for k in Kind if k not in (EVAL, EVAL_RESULTS, *SETUP_KINDS))  # what a training step's are
_TEXT = re.compile(
    r"^(?:(?P<batch_kind>[A-Z_]+)\(b(?P<batch>\d+)\)"
    r"|(?P<kind>[A-Z_]+)\(m(?P<microbatch>\d+)(?:,v(?P<version>\d+))?(?:,c(?P<chunk>\d+))?\))$"
)


@dataclass(frozen=True)
class Action:
    """One instruction for one stage. ``microbatch`` is -1 for a batch's actions (the update's parts, WAIT_SENDS);
    ``chunk``: which of the rank's chunks it runs (interleaved 1F1B: virtual stage ``chunk x d + rank``; else 0)."""

    kind: Kind
    batch: int
    microbatch: int = -1
    weight_version: int = -1
    chunk: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            object.__setattr__(self, "kind", Kind(self.kind))  # "F" or Kind.FORWARD; anything else raises

    def __str__(self) -> str:
        if self.kind in BATCH_KINDS:
            return f"{self.kind.value}(b{self.batch})"
        chunk = f",c{self.chunk}" if self.chunk else ""
        if self.weight_version < 0:  # evaluation: the newest weights
            return f"{self.kind.value}(m{self.microbatch}{chunk})"
        return f"{self.kind.value}(m{self.microbatch},v{self.weight_version}{chunk})"

    @classmethod
    def parse(cls, text: str, num_microbatches: int) -> Action:
        """The action ``str(action)`` wrote (its batch is ``microbatch // num_microbatches``)."""
        found = _TEXT.match(text.strip())
        if found is None or (found["kind"] not in (None, EVAL.value) and found["version"] is None):
            raise ValueError(f"{text!r} is not an action; e.g. 'F(m3,v1)', 'SEND_B(m0,v0)', 'STEP(b2)'")
        if found["batch"] is not None:
            return cls(Kind(found["batch_kind"]), int(found["batch"]))
        microbatch, version, chunk = int(found["microbatch"]), found["version"], int(found["chunk"] or 0)
        return cls(
            Kind(found["kind"]),
            microbatch // num_microbatches,
            microbatch,
            -1 if version is None else int(version),
            chunk,
        )


def listing(actions: Sequence[Action], marked: int | None = None) -> str:
    """``actions`` as text, one line each, ``marked`` (an index) flagged: what a stage was running."""
    return "\n".join(
        f"{'>>' if i == marked else '  '} {i:4d} {action}{'   <- failed here' if i == marked else ''}"
        for i, action in enumerate(actions)
    )


RECEIVES = (Kind.RECV_FORWARD, Kind.RECV_BACKWARD)
_WITH_NEXT = (Kind.SEND_FORWARD, Kind.RECV_BACKWARD)  # the point-to-point actions with the next stage
_WITH_PREVIOUS = (Kind.SEND_BACKWARD, Kind.RECV_FORWARD)


def fused_receive(actions: Sequence[Action], index: int) -> Action | None:
    """The receive issued in one batch with the send ``actions[index]``: the next action exchanging with the same
    neighbour, when it is a receive (1F1B's ``SEND_F(k)`` then ``RECV_B(j)``; ``SEND_B(j)`` then ``RECV_F(k+1)``),
    else None. Stage r's ``{SEND_F(k), RECV_B(j)}`` then meets stage r+1's ``{SEND_B(j), RECV_F(k)}``: the batching
    Megatron-LM and ``torch.distributed.pipelining`` use, deadlock-free when kernels run one at a time
    (``transport.py``; proven by ``nccl_model`` over ``comm_plan``'s lowering)."""
    kind = actions[index].kind
    if kind not in (Kind.SEND_FORWARD, Kind.SEND_BACKWARD):
        raise ValueError(f"{actions[index]} is not a send")
    same_peer = _WITH_NEXT if kind == Kind.SEND_FORWARD else _WITH_PREVIOUS
    for action in actions[index + 1 :]:
        if action.kind in same_peer:
            return action if action.kind in RECEIVES else None
    return None


def fuse_receives(actions: Sequence[Action]) -> dict[int, Action]:
    """The pass both the executor and the NCCL verifier read: for each send in ``actions``, by its index, the receive
    issued in one batch with it (``fused_receive``), where there is one. One backward scan of the list."""
    fused: dict[int, Action] = {}
    ahead: dict[tuple[Kind, ...], Action | None] = {_WITH_NEXT: None, _WITH_PREVIOUS: None}  # the next exchange
    for index in range(len(actions) - 1, -1, -1):
        action = actions[index]
        if action.kind in (Kind.SEND_FORWARD, Kind.SEND_BACKWARD):
            peer = _WITH_NEXT if action.kind == Kind.SEND_FORWARD else _WITH_PREVIOUS
            following = ahead[peer]
            if following is not None and following.kind in RECEIVES:
                fused[index] = following
        for peer in (_WITH_NEXT, _WITH_PREVIOUS):
            if action.kind in peer:
                ahead[peer] = action
    return fused
