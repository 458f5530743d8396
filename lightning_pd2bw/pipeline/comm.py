"""Point-to-point transport between neighbouring stages of one pipeline, designed from NCCL's semantics.

NCCL (and so every GPU run) differs from gloo in two ways that decide whether a schedule can hang:

- a send completes only when the peer posts the matching receive (gloo buffers it);
- the operations of one communicator run in issue order on one stream. Unbatched ``isend``/``irecv`` on
  the default group share *one* communicator per pair of ranks, for both directions.

With one channel per pair, 1F1B's steady state is a cycle: stage r queues SEND_F then RECV_B while
stage r+1 queues SEND_B then RECV_F, and neither send can complete. This transport therefore gives
each *direction* of each stage pair its own process group (its own communicator and stream):
activations flow on ``activations`` channels, gradients on ``gradients`` channels. On a channel only
one rank sends, and both ends issue their operations in microbatch order, so every operation's match
is the next one its peer posts; no cycle can form across channels because sends never block the
sender's program. ``nccl_model.py`` replays the real action lists under these rules and proves it for
every schedule, depth, width, clipping mode, tied parameters, drains and evaluation.

Shapes travel once per boundary and input shape, not per microbatch: both ends key the shapes of a
boundary's tensors by the microbatch's *input signature* (shapes and dtypes of the batch fields, which
every stage of a pipeline sees alike) and the phase (train/eval). The first message of a new key is
preceded by a small int64 header; afterwards the receiver allocates from its cache, with no host sync.
Gradients travel back without a header: the receiver sent the matching activations and knows their
shapes.

Receives are posted early (``post_forward`` / ``post_backward``): the executor posts each receive as soon as the
previous receive of its direction completed (or at the start of its segment), once its shapes are known, and waits
for it where the schedule uses the data. Under NCCL a send completes only when its receive is posted, so the
transfer then overlaps the computation in between instead of starting when the data is needed. Posted receives
match the sender's messages in order (one sender per channel), so they are kept in order too.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
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
    """The four one-directional channels of a stage (None at the pipeline's ends)."""

    activations_in: Any = None  # from the previous stage
    activations_out: Any = None  # to the next stage
    gradients_in: Any = None  # from the next stage
    gradients_out: Any = None  # to the previous stage


class StageLink:
    """Sends to and receives from the previous and next stage over one-directional channels."""

    def __init__(
        self,
        prev_rank: int | None,
        next_rank: int | None,
        device: torch.device,
        channels: LinkChannels | None = None,
    ) -> None:
        channels = channels or LinkChannels()
        if (prev_rank is not None and channels.activations_in is None) or (
            next_rank is not None and channels.activations_out is None
        ):
            raise ValueError(
                "StageLink needs one channel per direction to each neighbour (one shared channel deadlocks under "
                "NCCL): pass channels=build_groups(grid, ...).link from lightning_pd2bw.pipeline.grid"
            )
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self.device = device
        self.channels = channels
        self._pending: list[tuple[dist.Work, torch.Tensor, int]] = []  # (work, buffer, segment issued in)
        self._segment = 0
        self._sent_specs: dict[Hashable, Spec] = {}
        self._received_specs: dict[Hashable, Spec] = {}
        self.headers_sent = 0  # counters: one header per boundary and input signature, not per microbatch
        self.headers_received = 0
        self._posted: dict[str, list[tuple[Hashable, list[torch.Tensor], list[Any]]]] = {"forward": [], "backward": []}

    def _isend(self, tensor: torch.Tensor, dst: int, group: Any) -> None:
        tensor = tensor.contiguous()
        self._pending.append((dist.isend(tensor, dst, group=group), tensor, self._segment))

    @property
    def pending_sends(self) -> int:
        """Sends whose buffers are still held (bounded by two segments' sends)."""
        return len(self._pending)

    def begin_segment(self) -> None:
        """Start a new segment of actions; settle the sends issued two segments ago.

        2BW never drains between steps, so sends must be retired as it goes: a send's buffer (and its ``Work``)
        is held until the send is known complete. gloo's ``Work.is_completed`` stays False until ``wait`` is
        called, so pruning by it alone kept every send of the run (a leak of every boundary tensor). Waiting
        for the sends of segment s-2 at the start of segment s never blocks for long: the neighbour receives
        them in its segment s-1 at the latest, and it needs nothing from this stage's segment s to get there
        (checked for every layout under NCCL's rules by ``comm_plan`` + ``nccl_model``).
        """
        self._segment += 1
        for work, _, segment in self._pending:
            if segment <= self._segment - 2:
                work.wait()  # the same waits on every backend: traces replay deterministically
        self._pending = [entry for entry in self._pending if entry[2] > self._segment - 2]

    def _post(self, tensors: list[torch.Tensor], src: int, group: Any) -> tuple[list[torch.Tensor], list[Any]]:
        """Post every receive, in issue order on the channel, as the sender sent them."""
        return tensors, [dist.irecv(tensor, src, group=group) for tensor in tensors]

    @staticmethod
    def _wait(posted: Sequence[Any]) -> list[torch.Tensor]:
        tensors, works = posted
        for work in works:
            work.wait()
        return tensors

    def _recv_all(self, tensors: list[torch.Tensor], src: int, group: Any) -> list[torch.Tensor]:
        return self._wait(self._post(tensors, src, group))

    def post_forward(self, key: Hashable) -> bool:
        """Post the receives of the next activations (input signature ``key``) now; False while their shapes are
        not known yet (the first message of a key brings its header)."""
        spec = self._received_specs.get(key)
        if spec is None:
            return False
        buffers = [torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in spec]
        self._posted["forward"].append((key, *self._post(buffers, self.prev_rank, self.channels.activations_in)))
        return True

    def post_backward(self, like: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> None:
        """Post the receives of the next gradients (for the activations ``like`` sent) now."""
        buffers = [torch.empty(t.shape, dtype=dtype or t.dtype, device=t.device) for t in like]
        self._posted["backward"].append((None, *self._post(buffers, self.next_rank, self.channels.gradients_in)))

    def send_forward(self, tensors: Sequence[torch.Tensor], key: Hashable) -> None:
        assert self.next_rank is not None
        spec = spec_of(tensors)
        known = self._sent_specs.get(key)
        if known is None:
            self._isend(encode_header(tensors, self.device), self.next_rank, self.channels.activations_out)
            self._sent_specs[key] = spec
            self.headers_sent += 1
        elif known != spec:
            raise RuntimeError(
                f"the activations sent to rank {self.next_rank} changed shape for the same input shapes "
                f"({known} -> {spec}): pd2bw exchanges a boundary's shapes once per input shape, so a stage's "
                "outputs must be determined by the shapes of the batch (pad variable-length data to fixed shapes)"
            )
        for tensor in tensors:
            self._isend(tensor.detach(), self.next_rank, self.channels.activations_out)

    def recv_forward(self, key: Hashable) -> list[torch.Tensor]:
        assert self.prev_rank is not None
        if self._posted["forward"]:
            posted_key, *posted = self._posted["forward"].pop(0)
            assert posted_key == key, f"a receive posted for {posted_key} was used for {key}"
            return self._wait(posted)
        group = self.channels.activations_in
        spec = self._received_specs.get(key)
        if spec is None:
            header = self._recv_all(
                [torch.empty(HEADER_SIZE, dtype=torch.int64, device=self.device)], self.prev_rank, group
            )
            spec = self._received_specs[key] = decode_header(header[0])
            self.headers_received += 1
        buffers = [torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in spec]
        return self._recv_all(buffers, self.prev_rank, group)

    def send_backward(self, grads: Sequence[torch.Tensor]) -> None:
        assert self.prev_rank is not None
        for grad in grads:
            self._isend(grad, self.prev_rank, self.channels.gradients_out)

    def recv_backward(self, like: Sequence[torch.Tensor], dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """Gradients for the activations ``like`` sent, in ``dtype`` when they were sent in it."""
        assert self.next_rank is not None
        if self._posted["backward"]:
            return self._wait(self._posted["backward"].pop(0)[1:])
        buffers = [torch.empty(t.shape, dtype=dtype or t.dtype, device=t.device) for t in like]
        return self._recv_all(buffers, self.next_rank, self.channels.gradients_in)

    @property
    def posted_receives(self) -> int:
        """Receives posted early and not used yet (none between segments)."""
        return len(self._posted["forward"]) + len(self._posted["backward"])

    def wait_sends(self) -> None:
        for work, _, _ in self._pending:
            work.wait()
        self._pending.clear()
