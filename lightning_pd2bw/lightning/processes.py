"""Lightning's process plumbing for the strategy, as ``DDPStrategy`` has it: the processes and their ranks, the
launcher, the process group (with torchrun's restart-scoped store, NCCL's device binding and flight recorder),
the data-parallel sampler's shard, and the collectives Lightning calls (barrier, broadcast, reduce, all_gather).
Nothing here knows the pipeline beyond ``num_stages`` and ``data_parallel_size``."""

from __future__ import annotations

import os
import tempfile
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ParallelStrategy
from typing_extensions import override

from ..engine.comm.grid import device_barrier, visible_gpu
from ..engine.layout import Placement
from ..engine.options import PipelineOptions, Run
from ..observe import flight_recorder, watchdog
from . import checks
from .compat import (
    PatientSubprocessLauncher,
    all_gather_if_distributed,
    default_backend_for_device,
    init_process_group,
    reduce_if_distributed,
)

# 2BW holds two weight versions and sets gradients aside while the next batch runs: tensors of many sizes live and die
# out of order, which fragments the CUDA caching allocator's fixed segments. Expandable segments (Megatron's and
# torchtitan's recommendation) grow in place instead. Set where the user has not set the variable, before any CUDA
# allocation (the Trainer configures the launcher before it moves the model) and inherited by the processes launched.
ALLOCATOR_CONF = ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


WATCHDOG_MARGIN_S = 30.0  # past failure_timeout: the verdict read by every rank and their exits (a loaded host)


class PipelineProcesses(ParallelStrategy):
    """The base of ``PipeDream2BWStrategy``: the ``ParallelStrategy`` duties that are not the pipeline's, and the
    run its ``options`` resolve to on this world and precision (``_run``: depth and width for the launcher and the
    samplers)."""

    options: PipelineOptions

    def __init__(
        self, *args: Any, process_group_backend: str | None = None, timeout: timedelta = timedelta(minutes=30)
    ) -> None:
        super().__init__(*args)
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._num_nodes = 1
        self.run: Run | None = None  # the options resolved on the world and the precision (``_run``)

    def _run(self) -> Run:
        """The run resolved on this world and precision (once the world is known, and again after a plan)."""
        if self.run is None or self.run.world_size != self.world_size:
            self.run = self.options.resolve(self.world_size, str(self.precision_plugin.precision))
        return self.run

    @property
    def num_stages(self) -> int:
        return self._run().num_stages

    @property
    def num_microbatches(self) -> int:
        return self._run().num_microbatches

    @property
    def data_parallel_size(self) -> int:
        return self._run().width

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        device = self.parallel_devices[self.local_rank]
        return visible_gpu(device.index or 0) if device.type == "cuda" else device  # one GPU per task: cuda:0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # all stages of one pipeline read the same shard: the replica's (where ranks sit: ``layout.Placement``)
        placement = Placement(self._run().options.placement)
        _, replica = placement.position(self.global_rank, self.num_stages, self.data_parallel_size)
        return {"num_replicas": self.data_parallel_size, "rank": replica}

    @override
    def _configure_launcher(self) -> None:
        checks.check_precision(self._precision_plugin)
        os.environ.setdefault(*ALLOCATOR_CONF)
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            timeout = self.strategy_options.failure_timeout  # the watchdog's bound: it ends the job, with its code
            self._launcher = PatientSubprocessLauncher(
                self.cluster_environment,
                self.num_processes,
                self.num_nodes,
                grace=0.0 if timeout is None else timeout + WATCHDOG_MARGIN_S,
            )

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        from lightning.fabric.utilities.rank_zero import rank_zero_only as fabric_rank_zero_only
        from lightning.pytorch.utilities.rank_zero import rank_zero_only

        rank_zero_only.rank = fabric_rank_zero_only.rank = self.global_rank

    def init_process_group(self) -> None:
        """The default process group (once per process): NCCL on CUDA devices, gloo elsewhere."""
        backend = self._process_group_backend or default_backend_for_device(self.root_device)
        self._process_group_backend = backend
        if dist.is_initialized():
            return
        store = watchdog.attempt_scoped_store(self._timeout)  # torchrun restarts reuse one store
        extra = {"store": store} if store is not None else {}
        if self.root_device.type == "cuda":  # NCCL binds its communicators to this device at once
            extra["device_id"] = self.root_device
        if backend == "nccl":
            flight_recorder.enable_flight_recorder(os.environ.get("PD2BW_TRACE_DIR", tempfile.gettempdir()))
        init_process_group(self.cluster_environment, backend, timeout=self._timeout, **extra)

    @override
    def barrier(self, name: str | None = None) -> None:
        if dist.is_initialized():
            device_barrier(self.root_device)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        message = [obj]
        dist.broadcast_object_list(message, src=src)
        return message[0]

    @override
    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, torch.Tensor):
            return reduce_if_distributed(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def all_gather(self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
        return all_gather_if_distributed(tensor, group=group, sync_grads=sync_grads)
