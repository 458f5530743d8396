"""NCCL's flight recorder for a failed job: each rank keeps its last operations, dumped on a watchdog verdict and
read with ``torchfrtrace``; and the abort that frees a rank stuck in a collective (``watchdog.py`` calls both)."""

from __future__ import annotations

import os

import torch.distributed as dist

FLIGHT_RECORDER_ENTRIES = 2000  # the last collectives and point-to-point operations kept per rank


def enable_flight_recorder(folder: str) -> None:
    """Turn on NCCL's flight recorder (call before the NCCL process group exists; settings the user made win): each
    rank keeps its last operations, dumped to ``folder/nccl_trace_rank_<rank>`` on an NCCL timeout and on a
    watchdog verdict, to be read with ``torchfrtrace`` (which rank waited in which operation)."""
    prefix = os.path.join(folder, "nccl_trace_rank_")
    for key, value in (
        ("TORCH_FR_BUFFER_SIZE", str(FLIGHT_RECORDER_ENTRIES)),
        ("TORCH_NCCL_TRACE_BUFFER_SIZE", str(FLIGHT_RECORDER_ENTRIES)),
        ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"),
        ("TORCH_FR_DUMP_TEMP_FILE", prefix),
        ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", prefix),
    ):
        os.environ.setdefault(key, value)


def abort_nccl(rank: int) -> str | None:
    """On a verdict under NCCL: write this rank's flight-recorder dump, then abort every communicator (a kernel stuck
    in a collective or a receive would otherwise hold the GPU, and the process, until NCCL's own timeout). Returns
    the dump's path (None under gloo, or when nothing could be dumped)."""
    if not dist.is_initialized() or dist.get_backend() != "nccl":
        return None
    path = None
    try:
        from torch._C._distributed_c10d import _dump_fr_trace

        prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE", os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", ""))
        path = f"{prefix or '/tmp/nccl_trace_rank_'}{rank}"
        with open(path, "wb") as handle:
            handle.write(_dump_fr_trace(True, True, False))
    except Exception:  # noqa: BLE001 - a dump is best effort; the abort below is not
        path = None
    try:
        dist.distributed_c10d._abort_process_group()  # the default group: every communicator of this process
    except Exception:  # noqa: BLE001 - the process exits next either way
        pass
    return path
