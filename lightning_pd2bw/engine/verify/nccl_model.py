"""A model of NCCL's semantics that replays per-rank communication programs and finds deadlocks.

gloo buffers sends and lets any two operations between two ranks overtake each other, so a CPU test
cannot show a schedule that hangs on GPUs. This model can. Each rank's program is the sequence of
communication calls it issues (``Op``), with the rules NCCL imposes:

1. *Issue is asynchronous, completion is not*: ``isend``/``irecv``/``async_op=True`` collectives return at
   once; a ``wait`` (explicit, or implied by a blocking call or a host read such as ``.item()``) blocks
   the rank's program until that operation has completed.
2. *One communicator, one stream, issue order*: the operations a rank issues on one communicator run in
   the order issued; an operation starts only when every earlier one on that communicator has completed.
   Point-to-point operations of a group issued alone use one communicator per pair of ranks, for both directions
   (ProcessGroupNCCL's unbatched send/recv); batched ones and collectives use the group's communicator.
3. *Rendezvous*: a send completes only together with the matching receive (no buffering); a collective
   completes only when every member has reached it, and all must be the same collective.
4. *Threads are independent*: a rank's calls from another thread (an asynchronous checkpoint's collectives on a
   group of their own) form a program of their own, ordered only by the communicators they share.
5. *A batch is one kernel*: the point-to-point operations of one ``batch_isend_irecv`` (one NCCL group) are
   issued together and progress together; the batch leaves its queue when all of them completed.

``serialized=True`` adds the strictest rule NCCL allows: kernels of *different* communicators run one at a time
(``CUDA_DEVICE_MAX_CONNECTIONS=1``; NCCL promises no concurrency between communicators). Every operation a rank's
main thread issues then runs in that rank's issue order, whatever its communicator (a gloo group's excepted, named
``... (host)``: CPU tensors, never on the device): an operation posted first blocks everything behind it. A transport that relies on communicators progressing independently hangs here.

``simulate`` runs every rank until all programs end or nothing can move (a deadlock, reported with each rank's blocked
operation and the communicators' heads). Programs come from ``record_calls`` (what a real process issues through
``torch.distributed``: gloo issues the same calls as NCCL) and ``comm_plan.py`` (the ranks' programs, lowered).
"""

from __future__ import annotations

import functools
import inspect
import json
import threading
from collections import defaultdict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from ..comm.grid import HOST
from ..layout import Word


class CallKind(Word):
    """What a recorded or lowered call does (its text in a trace file is the value)."""

    SEND, RECV, COLLECTIVE, WAIT = "send", "recv", "collective", "wait"


SEND, RECV, COLLECTIVE, WAIT = CallKind


class Op(NamedTuple):
    """One communication call of one rank. ``handle`` names the operation an issue creates or a wait awaits."""

    kind: CallKind
    handle: int
    channel: str = ""  # the process group (its description)
    peer: int = -1  # send: destination, recv: source (global ranks)
    members: tuple[int, ...] = ()  # collective: the group's global ranks
    name: str = ""  # collective: all_reduce, broadcast, ...
    label: str = ""  # where the call comes from (an action, an update part)
    thread: str = ""  # the issuing thread ("" for the main thread)
    batch: int = -1  # point-to-point: the batch_isend_irecv it was issued in (-1: alone)

    def __str__(self) -> str:
        if self.kind == WAIT:
            return f"wait(#{self.handle}{', ' + self.label if self.label else ''})"
        where = f"{self.channel} peer {self.peer}" if self.kind in (SEND, RECV) else self.channel
        return f"{self.kind}{'/' + self.name if self.name else ''}(#{self.handle} on {where}{', ' + self.label if self.label else ''})"

    @staticmethod
    def from_dict(data: dict) -> Op:
        return Op(**{**data, "kind": CallKind(data["kind"]), "members": tuple(data.get("members", ()))})

    def as_dict(self) -> dict:
        return self._asdict()


Programs = dict[int, list[Op]]


class Deadlock(RuntimeError):
    """No rank can move: the message lists each rank's blocked operation and each communicator's head."""


class MismatchedCollective(RuntimeError):
    """The members of a communicator reached different collectives."""


def communicator(op: Op, rank: int) -> str:
    """Which NCCL communicator (and stream) an operation runs on: a point-to-point one alone, its pair's; in a batch,
    its group's (ProcessGroupNCCL picks a batch's as a collective's: the batch may reach other ranks than the pair)."""
    if op.kind in (SEND, RECV) and op.batch < 0:
        return _pair_communicator(op.channel, min(rank, op.peer), max(rank, op.peer))
    return op.channel


@functools.lru_cache(maxsize=4096)
def _pair_communicator(channel: str, low: int, high: int) -> str:
    return f"{channel} p2p {low}-{high}"


@dataclass
class Outcome:
    steps: int  # operations completed
    max_queued: int  # the longest queue of issued, unfinished kernels one rank had on one communicator (or device)


def simulate(programs: Programs, serialized: bool = False) -> Outcome:
    """Run ``programs`` under NCCL's rules (``serialized``: kernels one at a time per rank); raise ``Deadlock`` or
    ``MismatchedCollective``, else the outcome."""
    lanes = _lanes(programs)
    lanes_of: dict[int, list[tuple[int, str]]] = defaultdict(list)  # rank -> its lanes, the main thread's first
    for lane in lanes:
        lanes_of[lane[0]].append(lane)
    pc = dict.fromkeys(lanes, 0)
    queues: dict[tuple[str, int], deque[list[Op]]] = defaultdict(deque)  # (queue, rank) -> kernels, each 1+ ops
    finished: set[tuple[int, int]] = set()  # (rank, handle) of completed operations
    dirty: list[tuple[str, int]] = []  # queues whose head may now progress
    runnable = list(sorted(programs))
    completed = max_queued = 0

    def queue_of(op: Op, rank: int) -> str:
        on_device = not op.thread and not op.channel.endswith(HOST)
        return "device" if serialized and on_device else communicator(op, rank)

    def advance(rank: int) -> None:
        nonlocal max_queued
        for lane in lanes_of[rank]:
            program = lanes[lane]
            while pc[lane] < len(program):
                op = program[pc[lane]]
                if op.kind == WAIT:
                    if (rank, op.handle) not in finished:
                        break
                    pc[lane] += 1
                    continue
                kernel = [op]
                pc[lane] += 1
                while op.batch >= 0 and pc[lane] < len(program) and program[pc[lane]].batch == op.batch:
                    kernel.append(program[pc[lane]])
                    pc[lane] += 1
                key = (queue_of(op, rank), rank)
                queues[key].append(kernel)
                max_queued = max(max_queued, len(queues[key]))
                if len(queues[key]) == 1:
                    dirty.append(key)

    def complete(rank: int, op: Op) -> None:
        nonlocal completed
        finished.add((rank, op.handle))
        completed += 1

    def pop_if_done(key: tuple[str, int]) -> None:
        queue = queues[key]
        if queue and all((key[1], op.handle) in finished for op in queue[0]):
            queue.popleft()
            runnable.append(key[1])
            if queue:
                dirty.append(key)

    def pending(kernel: list[Op], rank: int, kind: str, peer: int, channel: str) -> list[Op]:
        return [
            op
            for op in kernel
            if op.kind == kind and op.peer == peer and op.channel == channel and (rank, op.handle) not in finished
        ]

    while runnable or dirty:
        while runnable:
            advance(runnable.pop())
        while dirty:
            key = dirty.pop()
            queue_name, rank = key
            if not queues[key]:
                continue
            head = queues[key][0]
            if head[0].kind == COLLECTIVE:
                op = head[0]
                keys = [(queue_of(op, member), member) for member in op.members]
                heads = [queues[k][0] if queues.get(k) else None for k in keys]
                ready = all(h is not None and h[0].kind == COLLECTIVE and h[0].channel == op.channel for h in heads)
                if ready:
                    if len({h[0].name for h in heads}) > 1:
                        raise MismatchedCollective(
                            f"communicator {op.channel}: members reached different collectives: "
                            + ", ".join(f"rank {m}: {h[0]}" for m, h in zip(op.members, heads))
                        )
                    for member, member_key, member_head in zip(op.members, keys, heads):
                        complete(member, member_head[0])
                        pop_if_done(member_key)
                continue
            for peer in {op.peer for op in head}:
                peer_key = (queue_name, peer)  # the pair's or the group's communicator (or the peer's device queue)
                if not queues.get(peer_key):
                    continue
                other = queues[peer_key][0]
                for channel in {op.channel for op in head if op.peer == peer}:
                    for kind, wanted in ((SEND, RECV), (RECV, SEND)):  # FIFO per direction, as NCCL matches
                        for mine, theirs in zip(
                            pending(head, rank, kind, peer, channel), pending(other, peer, wanted, rank, channel)
                        ):
                            complete(rank, mine)
                            complete(peer, theirs)
                pop_if_done(peer_key)
            pop_if_done(key)
    stuck = [lane for lane in lanes if pc[lane] < len(lanes[lane])]
    leftover = {key: q for key, q in queues.items() if q}
    if stuck or leftover:
        raise Deadlock(_report(lanes, pc, leftover, serialized))
    return Outcome(completed, max_queued)


def _lanes(programs: Programs) -> dict[tuple[int, str], list[Op]]:
    """Each rank's program split by issuing thread (the main thread's first), order kept within each."""
    lanes: dict[tuple[int, str], list[Op]] = {}
    for rank in sorted(programs):
        lanes[(rank, "")] = []
        for op in programs[rank]:
            lanes.setdefault((rank, op.thread), []).append(op)
    return lanes


def _report(
    lanes: dict[tuple[int, str], list[Op]],
    pc: dict[tuple[int, str], int],
    leftover: dict[tuple[str, int], deque[list[Op]]],
    serialized: bool,
) -> str:
    lines = ["deadlock under NCCL semantics" + (" (serialized kernels):" if serialized else ":")]
    for (rank, thread), program in lanes.items():
        who = f"rank {rank}" + (f" thread {thread}" if thread else "")
        if pc[(rank, thread)] < len(program):
            lines.append(f"  {who} blocked at op {pc[(rank, thread)]}: {program[pc[(rank, thread)]]}")
        elif not thread:
            lines.append(f"  {who} finished its program")
    for (comm, rank), queue in sorted(leftover.items()):
        head = " + ".join(map(str, queue[0]))
        lines.append(
            f"  rank {rank} on [{comm}] waits to run: {head}" + (f" (+{len(queue) - 1})" if len(queue) > 1 else "")
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- recording
def _channel(group: Any) -> str:
    import torch.distributed as dist

    if group is None or group is dist.GroupMember.WORLD:
        return "default_pg"
    desc = getattr(group, "group_desc", "") or ""
    return desc if desc and desc != "undefined" else f"group {group.group_name}"


def _members(group: Any) -> tuple[int, ...]:
    import torch.distributed as dist

    return tuple(dist.get_process_group_ranks(group if group is not None else dist.GroupMember.WORLD))


def _thread() -> str:
    current = threading.current_thread()
    return "" if current is threading.main_thread() else current.name


class _RecordedWork:
    """A ``Work`` whose ``wait`` is recorded (everything else is the real one's)."""

    def __init__(self, work: Any, recorder: CallRecorder, handle: int, label: str) -> None:
        self._work, self._recorder, self._handle, self._label = work, recorder, handle, label

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._recorder.append(Op(WAIT, self._handle, label=self._label, thread=_thread()))
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class CallRecorder:
    """The communication program of this process, as ``Op``s (see ``record_calls``)."""

    P2P = {"isend": SEND, "irecv": RECV, "send": SEND, "recv": RECV}
    COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor")
    COLLECTIVES += ("reduce", "gather", "scatter", "all_to_all_single", "barrier")

    def __init__(self) -> None:
        self.ops: list[Op] = []
        self._handles = 0
        self._batches = 0
        self._batch = -1  # the batch_isend_irecv being issued (-1: none)
        self._lock = threading.Lock()  # an asynchronous checkpoint issues calls from its own thread

    def _issue(self, **fields: Any) -> int:
        with self._lock:
            handle = self._handles
            self._handles += 1
            self.ops.append(
                Op(handle=handle, thread=_thread(), batch=self._batch if fields["kind"] != COLLECTIVE else -1, **fields)
            )
        return handle

    def wrap_batch(self, fn: Any) -> Any:
        """``batch_isend_irecv``: the operations it issues are one batch (one NCCL group, one kernel)."""

        @functools.wraps(fn)
        def recorded(p2p_op_list: Any) -> Any:
            with self._lock:
                self._batches += 1
                self._batch = self._batches
            try:
                return fn(p2p_op_list)
            finally:
                self._batch = -1

        return recorded

    def append(self, op: Op) -> None:
        with self._lock:
            self.ops.append(op)

    def wrap(self, name: str, fn: Any) -> Any:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            import torch.distributed as dist

            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            params = bound.arguments
            group = params.get("group")
            if name in self.P2P:
                peer_key = "dst" if self.P2P[name] == SEND else "src"
                peer = params.get(peer_key)
                if peer is None and params.get(f"group_{peer_key}") is not None:
                    peer = dist.get_global_rank(group, params[f"group_{peer_key}"])
                handle = self._issue(kind=self.P2P[name], channel=_channel(group), peer=int(peer), label=name)
                asynchronous = name in ("isend", "irecv")
            else:
                handle = self._issue(
                    kind=COLLECTIVE, channel=_channel(group), members=_members(group), name=name, label=name
                )
                asynchronous = bool(params.get("async_op", False))
            result = fn(*args, **kwargs)
            if asynchronous and result is not None:
                return _RecordedWork(result, self, handle, name)
            self.append(Op(WAIT, handle, label=name, thread=_thread()))
            return result

        return recorded

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps([op.as_dict() for op in self.ops]))


def load_program(path: Path) -> list[Op]:
    return [Op.from_dict(item) for item in json.loads(Path(path).read_text())]


@contextmanager
def record_calls() -> Iterator[CallRecorder]:
    """Record every ``torch.distributed`` point-to-point and collective call this process makes.

    Instrumentation, not a mock: each call still runs. Composite helpers (``broadcast_object_list``,
    ``all_gather_object``) are recorded through the primitives they call.
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    recorder = CallRecorder()
    saved = []
    for name in (*recorder.P2P, *recorder.COLLECTIVES):
        original = getattr(c10d, name)
        wrapped = recorder.wrap(name, original)
        for namespace in (dist, c10d):
            saved.append((namespace, name, getattr(namespace, name)))
            setattr(namespace, name, wrapped)
    batched = recorder.wrap_batch(c10d.batch_isend_irecv)
    for namespace in (dist, c10d):
        saved.append((namespace, "batch_isend_irecv", namespace.batch_isend_irecv))
        namespace.batch_isend_irecv = batched
    try:
        yield recorder
    finally:
        for namespace, name, original in saved:
            setattr(namespace, name, original)
