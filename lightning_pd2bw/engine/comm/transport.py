"""Point-to-point transport between neighbouring stages of one pipeline, designed from NCCL's semantics.

NCCL (and so every GPU run) differs from gloo in three ways that decide whether a schedule can hang:

- a send completes only when the peer posts the matching receive (gloo buffers small messages);
- the operations of one communicator run in issue order on one stream;
- kernels of *different* communicators may run one at a time (with ``CUDA_DEVICE_MAX_CONNECTIONS=1``, common in
  Megatron-style jobs, or whenever NCCL's kernels cannot be co-resident): an operation posted first blocks every
  kernel behind it, whatever its communicator.

So no transport can rely on communicators progressing independently (the previous design's separate channel per
direction did). This one follows Megatron-LM and ``torch.distributed.pipelining``: one process group per stage pair
(both directions), and each send issued in **one batch** (``batch_isend_irecv``: one NCCL group, one kernel) with
the next receive the schedule takes from the same neighbour (``schedule.fused_receive``): stage r's
``{SEND_F(k), RECV_B(j)}`` meets stage r+1's ``{SEND_B(j), RECV_F(k)}``. Every rank then issues its operations with a
neighbour in an order the neighbour's order matches, with no operation waiting on one queued behind it; the NCCL
model proves it under serialized kernels (``nccl_model.simulate(serialized=True)``) for every schedule, depth,
width, clipping mode, tied parameters, drains and evaluation (``comm_plan``), and the distributed tests replay
real runs' calls under it.

Memory does not grow with the number of microbatches: a batch's buffers are held until the batch is known
complete, and that is early. When a receive from a neighbour completes, the neighbour has posted (in the batch
that sent it, or before) the receives of everything this stage sent it so far; the stage then waits for all its
sends to that neighbour (complete or about to be) and drops their buffers. A stage so holds O(depth) messages,
never O(m) (``held_bytes``, ``peak_held_bytes``). Receive buffers are handed to the stage's compute and freed with
its stash.

Shapes travel once per boundary and input shape, not per microbatch: both ends key the shapes of a boundary's
tensors by the microbatch's *input signature* (shapes and dtypes of the batch fields, which every stage of a
pipeline sees alike) and the phase (train/eval). The first message of a new key is preceded by a small int64
header; afterwards the receiver allocates from its cache, with no host sync. Gradients travel back without a
header: the receiver sent the matching activations and knows their shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
]
_MAX_TENSORS = 8
_MAX_DIMS = 6
_FIELDS = 2 + _MAX_DIMS  # dtype code, ndim, dims
HEADER_SIZE = 1 + _MAX_TENSORS * _FIELDS

Spec = tuple[tuple[torch.dtype, tuple[int, ...]], ...]


def spec_of(tensors: Sequence[torch.Tensor]) -> Spec:
    return tuple((t.dtype, tuple(t.shape)) for t in tensors)


def encode_header(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """int64 header describing ``tensors`` (at most 8, each of rank <= 6)."""
    if len(tensors) > _MAX_TENSORS:
        raise ValueError(f"a stage boundary carries {len(tensors)} tensors; at most {_MAX_TENSORS} are supported")
    header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
    header[0] = len(tensors)
    for i, tensor in enumerate(tensors):
        if tensor.dim() > _MAX_DIMS:
            raise ValueError(f"a stage boundary tensor has rank {tensor.dim()}; at most {_MAX_DIMS} is supported")
        if tensor.dtype not in _DTYPES:
            raise ValueError(f"a stage boundary tensor has dtype {tensor.dtype}; supported: {_DTYPES}")
        base = 1 + i * _FIELDS
        header[base] = _DTYPES.index(tensor.dtype)
        header[base + 1] = tensor.dim()
        header[base + 2 : base + 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return header.to(device)


def decode_header(header: torch.Tensor) -> Spec:
    values = header.tolist()
    specs = []
    for i in range(values[0]):
        base = 1 + i * _FIELDS
        ndim = values[base + 1]
        specs.append((_DTYPES[values[base]], tuple(values[base + 2 : base + 2 + ndim])))
    return tuple(specs)


def carries_gradient(tensor: torch.Tensor) -> bool:
    """Stage-boundary tensors that get a gradient back: the floating-point ones."""
    return tensor.is_floating_point()


def input_signature(value: Any) -> Hashable:
    """What a microbatch looks like to every stage: the structure, shapes and dtypes of its tensors."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), str(value.dtype))
    if isinstance(value, dict):
        return tuple((key, input_signature(item)) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(input_signature(item) for item in value))
    return type(value).__name__


@dataclass(frozen=True)
class LinkChannels:
    """The process group shared with each neighbour, both directions (None at the pipeline's ends)."""

    previous: Any = None  # with the previous stage
    next: Any = None  # with the next stage


@dataclass
class _Batch:
    """One ``batch_isend_irecv``: its works (NCCL returns one for the group), the buffers it must keep alive."""

    works: list[Any]
    buffers: list[torch.Tensor]
    sent_bytes: int = 0

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []


@dataclass
class _Posted:
    """Receives issued in a batch with a send, waited for where the schedule uses them."""

    key: Hashable
    tensors: list[torch.Tensor]
    batch: _Batch


@dataclass
class _Staged:
    """A send or receive of the ring's current tick (``StageLink.exchange``)."""

    peer: int
    tensors: list[torch.Tensor]
    key: Hashable | None
    send: bool
    into: Callable[[list[torch.Tensor]], None] | None = None


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class StageLink:
    """Sends to and receives from the previous and next stage, one batch per send and the receive fused with it."""

    def __init__(
        self,
        prev_rank: int | None,
        next_rank: int | None,
        device: torch.device,
        channels: LinkChannels | None = None,
    ) -> None:
        channels = channels or LinkChannels()
        if (prev_rank is not None and channels.previous is None) or (next_rank is not None and channels.next is None):
            raise ValueError(
                "StageLink needs a process group shared with each neighbour: pass channels=build_groups(grid, ...).link "
                "from lightning_pd2bw.engine.comm.grid"
            )
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self.device = device
        self.channels = channels
        self._unsettled: dict[int, list[_Batch]] = {}  # peer -> batches whose sends are not known complete
        self._sent_specs: dict[Hashable, Spec] = {}
        self._received_specs: dict[Hashable, Spec] = {}
        self.headers_sent = 0  # counters: one header per boundary and input signature, not per microbatch
        self.headers_received = 0
        self._posted: dict[str, list[_Posted]] = {"forward": [], "backward": []}
        self.peak_held_bytes = 0
        self.peak_pending_sends = 0
        self._staged: list[_Staged] = []  # the ring's lockstep: this tick's sends and receives (``exchange``)
        self._ticks: list[_Batch] = []  # the ring's batches not yet waited for, in issue order
        self._arriving: dict[int, _Batch] = {}  # a tick's received tensors (by list) -> their batch

    # ------------------------------------------------------------------ batches
    def _group(self, peer: int) -> Any:
        return self.channels.previous if peer == self.prev_rank else self.channels.next

    def _issue(self, peer: int, sends: Sequence[torch.Tensor], receives: Sequence[torch.Tensor]) -> _Batch:
        """One ``batch_isend_irecv`` with ``peer``: ``sends`` in order, then ``receives`` in order."""
        group = self._group(peer)
        sends = [t.contiguous() for t in sends]
        ops = [dist.P2POp(dist.isend, t, peer, group) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, peer, group) for t in receives]
        if not ops:  # e.g. a stage whose inputs carry no gradient sends none back
            return _Batch([], [])
        batch = _Batch(list(dist.batch_isend_irecv(ops)), [*sends, *receives], _nbytes(sends))
        if sends:
            self._unsettled.setdefault(peer, []).append(batch)
        self._account()
        return batch

    def _account(self) -> None:
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        self.peak_pending_sends = max(self.peak_pending_sends, self.pending_sends)

    def settle(self, peer: int, keep: int = 0) -> None:
        """Wait for the sends to ``peer`` (all but the newest ``keep`` batches) and drop their buffers."""
        batches = self._unsettled.get(peer, [])
        while len(batches) > keep:
            batches.pop(0).wait()

    @property
    def pending_sends(self) -> int:
        """Batches of sends whose buffers are still held (O(depth), never O(microbatches))."""
        return sum(len(batches) for batches in self._unsettled.values())

    @property
    def held_bytes(self) -> int:
        """Bytes of the messages this link holds now: sends not known complete, receives posted and not used."""
        sent = sum(b.sent_bytes for batches in self._unsettled.values() for b in batches)
        sent += sum(_nbytes(b.buffers) for b in self._ticks)  # the ring's: a tick's sends and receives
        posted = sum(_nbytes(p.tensors) for queue in self._posted.values() for p in queue)
        return sent + posted

    @property
    def posted_receives(self) -> int:
        """Receives issued with a send and not used yet, or a tick's not used yet (none between segments)."""
        return len(self._posted["forward"]) + len(self._posted["backward"]) + len(self._staged) + len(self._arriving)

    def _receive(self, peer: int, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        self._issue(peer, [], tensors).wait()
        self.settle(peer)  # the peer sent after posting the receives of everything sent to it so far
        return tensors

    def _use(self, direction: str, peer: int) -> list[torch.Tensor]:
        posted = self._posted[direction].pop(0)
        posted.batch.wait()
        self.settle(peer)
        return posted.tensors

    # ------------------------------------------------------------------ activations
    def _activation_sends(self, tensors: Sequence[torch.Tensor], key: Hashable) -> list[torch.Tensor]:
        header = self._header(tensors, key)
        return header + [t.detach() for t in tensors]

    def _header(self, tensors: Sequence[torch.Tensor], key: Hashable) -> list[torch.Tensor]:
        """The header to send before ``tensors`` (their shapes, the first time ``key`` is sent), else none."""
        spec = spec_of(tensors)
        known = self._sent_specs.get(key)
        if known is None:
            self._sent_specs[key] = spec
            self.headers_sent += 1
            return [encode_header(tensors, self.device)]
        if known != spec:
            raise RuntimeError(
                f"the activations sent to rank {self.next_rank} changed shape for the same input shapes "
                f"({known} -> {spec}): pd2bw exchanges a boundary's shapes once per input shape, so a stage's "
                "outputs must be determined by the shapes of the batch (pad variable-length data to fixed shapes)"
            )
        return []

    def send_forward(
        self,
        tensors: Sequence[torch.Tensor],
        key: Hashable,
        then_receive_like: Sequence[torch.Tensor] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """Send activations to the next stage; ``then_receive_like``: in the same batch, post the receive of the
        gradients for those (earlier) activations (``schedule.fused_receive``), used by ``recv_backward``."""
        assert self.next_rank is not None
        sends = self._activation_sends(tensors, key)
        receives = []
        if then_receive_like is not None:
            receives = [torch.empty(t.shape, dtype=dtype or t.dtype, device=t.device) for t in then_receive_like]
        batch = self._issue(self.next_rank, sends, receives)
        if then_receive_like is not None:
            self._posted["backward"].append(_Posted(None, receives, batch))
            self._account()

    def recv_forward(self, key: Hashable) -> list[torch.Tensor]:
        assert self.prev_rank is not None
        if self._posted["forward"]:
            assert self._posted["forward"][0].key == key, f"a receive posted for {self._posted['forward'][0].key}"
            return self._use("forward", self.prev_rank)
        spec = self._received_specs.get(key)
        if spec is None:
            header = self._receive(self.prev_rank, [torch.empty(HEADER_SIZE, dtype=torch.int64, device=self.device)])
            spec = self._received_specs[key] = decode_header(header[0])
            self.headers_received += 1
        return self._receive(
            self.prev_rank, [torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in spec]
        )

    # ------------------------------------------------------------------ gradients
    def send_backward(self, grads: Sequence[torch.Tensor], then_receive: Hashable | None = None) -> bool:
        """Send gradients to the previous stage; ``then_receive``: the input signature of the activations the
        schedule receives next from it, posted in the same batch when their shapes are known (True then)."""
        assert self.prev_rank is not None
        spec = self._received_specs.get(then_receive) if then_receive is not None else None
        receives = [torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in spec or ()]
        batch = self._issue(self.prev_rank, grads, receives)
        if spec is not None:
            self._posted["forward"].append(_Posted(then_receive, receives, batch))
            self._account()
        return spec is not None

    def recv_backward(self, like: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """Gradients for the activations ``like`` sent, in ``dtype`` when they were sent in it."""
        assert self.next_rank is not None
        if self._posted["backward"]:
            return self._use("backward", self.next_rank)
        buffers = [torch.empty(t.shape, dtype=dtype or t.dtype, device=t.device) for t in like]
        return self._receive(self.next_rank, buffers)

    def wait_sends(self) -> None:
        for peer in list(self._unsettled):
            self.settle(peer)
        while self._ticks:
            self._ticks.pop(0).wait()

    # ------------------------------------------------------------------ the ring's lockstep (``schedules/lockstep.py``)
    def stage_send(self, peer: int, tensors: Sequence[torch.Tensor], key: Hashable | None = None) -> None:
        """A send of this tick's batch (``exchange``); ``key``: activations, their shapes sent once per key."""
        self._staged.append(_Staged(peer, [t.detach().contiguous() for t in tensors], key, send=True))

    def stage_receive(
        self, peer: int, into: Callable, key: Hashable | None = None, like: Sequence = (), dtype: Any = None
    ) -> None:
        """A receive of this tick's batch, handed to ``into`` once issued (``arrived`` waits for it): activations of
        shape key ``key``, or gradients for the activations ``like`` (in ``dtype`` when they were sent in it)."""
        buffers = [torch.empty(t.shape, dtype=dtype or t.dtype, device=t.device) for t in like]
        self._staged.append(_Staged(peer, buffers, key, send=False, into=into))

    def exchange(self) -> None:
        """``TICK``: this tick's sends and receives in one ``batch_isend_irecv`` on the ring's group (the headers of
        new shape keys in one before it, waited for), the receives handed on. Every rank's batch of a tick meets
        its neighbours' batches of the same tick only."""
        staged, self._staged = self._staged, []
        headers = [(item, header) for item in staged if item.key is not None for header in self._item_header(item)]
        if headers:
            self._batch([(item.peer, header, item.send) for item, header in headers]).wait()
            for item, header in (pair for pair in headers if not pair[0].send):
                self._received_specs[item.key] = decode_header(header)
                self.headers_received += 1
                self._item_header(item)  # its buffers, from the shapes just received
        self._ticks.append(self._batch([(item.peer, t, item.send) for item in staged for t in item.tensors]))
        self._account()
        for item in (item for item in staged if not item.send):
            self._arriving[id(item.tensors)] = self._ticks[-1]
            item.into(item.tensors)

    def arrived(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` a tick received (``stage_receive``), complete: its batch waited for, and every earlier one (a
        communicator runs its batches in order, so they are done by then on NCCL). Anything else as it is."""
        batch = self._arriving.pop(id(tensors), None)
        while batch is not None and batch.works:
            self._ticks.pop(0).wait()
        return tensors

    def _item_header(self, item: _Staged) -> list[torch.Tensor]:
        """The header ``item`` sends or receives first, if any; a receive of known shapes gets its buffers."""
        if item.send:
            return self._header(item.tensors, item.key)
        spec = self._received_specs.get(item.key)
        if spec is None:
            return [torch.empty(HEADER_SIZE, dtype=torch.int64, device=self.device)]
        item.tensors = [torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in spec]
        return []

    def _batch(self, ops: Sequence[tuple[int, torch.Tensor, bool]]) -> _Batch:
        """One ``batch_isend_irecv`` of (peer, tensor, is a send), sends first."""
        group = self.channels.next if self.channels.next is not None else self.channels.previous
        ordered = sorted(ops, key=lambda op: not op[2])
        p2p = [dist.P2POp(dist.isend if send else dist.irecv, t, peer, group) for peer, t, send in ordered]
        return _Batch(list(dist.batch_isend_irecv(p2p)) if p2p else [], [t for _, t, _ in ops])


def as_tuple(value: Any) -> tuple[torch.Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)


def wire_bytes(value: Any, boundary_dtype: torch.dtype | None) -> int:
    """Bytes of a stage's output as it crosses the boundary (``StageExecutor._wire``): floating-point tensors in
    ``boundary_dtype`` (None: their own), the others as they are. What the planner counts per message."""
    tensors = [t for t in as_tuple(value) if isinstance(t, torch.Tensor)]
    return sum(
        t.numel()
        * (boundary_dtype.itemsize if boundary_dtype is not None and t.is_floating_point() else t.element_size())
        for t in tensors
    )
