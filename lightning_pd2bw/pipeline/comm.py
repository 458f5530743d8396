"""Point-to-point transport between neighbouring stages of one pipeline.

Activations travel as a small int64 header (count, dtype, shape of each tensor) followed by the
tensors, so stages need no shape inference. Gradients travel back without a header: the receiver
sent the matching activations and knows their shapes. Sends are asynchronous (``isend``) and kept
alive until ``wait_sends``; receives block, right before their data is used.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def encode_header(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """int64 header describing ``tensors`` (at most 8, each of rank <= 6)."""
    if len(tensors) > _MAX_TENSORS:
        raise ValueError(f"a stage boundary carries {len(tensors)} tensors; at most {_MAX_TENSORS} are supported")
    header = torch.zeros(HEADER_SIZE, dtype=torch.int64)
    header[0] = len(tensors)
    for i, tensor in enumerate(tensors):
        if tensor.dim() > _MAX_DIMS:
            raise ValueError(f"a stage boundary tensor has rank {tensor.dim()}; at most {_MAX_DIMS} is supported")
        base = 1 + i * _FIELDS
        header[base] = _DTYPES.index(tensor.dtype)
        header[base + 1] = tensor.dim()
        header[base + 2 : base + 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return header.to(device)


def decode_header(header: torch.Tensor) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    values = header.tolist()
    specs = []
    for i in range(values[0]):
        base = 1 + i * _FIELDS
        ndim = values[base + 1]
        specs.append((_DTYPES[values[base]], tuple(values[base + 2 : base + 2 + ndim])))
    return specs


def carries_gradient(tensor: torch.Tensor) -> bool:
    """Stage-boundary tensors that get a gradient back: the floating-point ones."""
    return tensor.is_floating_point()


class StageLink:
    """Sends to and receives from the previous and next stage (global ranks, default group)."""

    def __init__(self, prev_rank: int | None, next_rank: int | None, device: torch.device) -> None:
        self.prev_rank = prev_rank
        self.next_rank = next_rank
        self.device = device
        self._pending: list[tuple[dist.Work, object]] = []

    def _isend(self, tensor: torch.Tensor, dst: int) -> None:
        # forget sends that have completed so their buffers are freed (2BW never drains in between)
        self._pending = [(work, buf) for work, buf in self._pending if not work.is_completed()]
        tensor = tensor.contiguous()
        self._pending.append((dist.isend(tensor, dst), tensor))

    def _recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        dist.irecv(tensor, src).wait()
        return tensor

    def send_forward(self, tensors: Sequence[torch.Tensor]) -> None:
        assert self.next_rank is not None
        self._isend(encode_header(tensors, self.device), self.next_rank)
        for tensor in tensors:
            self._isend(tensor.detach(), self.next_rank)

    def recv_forward(self) -> list[torch.Tensor]:
        assert self.prev_rank is not None
        header = self._recv(torch.empty(HEADER_SIZE, dtype=torch.int64, device=self.device), self.prev_rank)
        return [
            self._recv(torch.empty(shape, dtype=dtype, device=self.device), self.prev_rank)
            for dtype, shape in decode_header(header)
        ]

    def send_backward(self, grads: Sequence[torch.Tensor]) -> None:
        assert self.prev_rank is not None
        for grad in grads:
            self._isend(grad, self.prev_rank)

    def recv_backward(self, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        assert self.next_rank is not None
        return [self._recv(torch.empty_like(t), self.next_rank) for t in like]

    def wait_sends(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
