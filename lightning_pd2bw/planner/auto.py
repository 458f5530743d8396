"""``plan="auto"``: at start-up, on the real world size, profile the model, measure the links, plan.

Rank 0 profiles every layer on its device (``measure.py``) at each candidate microbatch size and
times messages to a neighbour; every rank joins the link measurement; rank 0 searches and
broadcasts the chosen plan, so all ranks partition identically.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..engine.comm.microbatch import resize_batch, to_device
from ..engine.options import Run
from .cost import NCCL_GROUP_BYTES, ModelProfile, Prediction
from .hardware import ClusterSpec, DeviceSpec
from .measure import measure_layers, synchronize
from .search import divisors, search


def shared_layers(layers: Sequence[nn.Module]) -> tuple[tuple[int, int, int], ...]:
    """(first layer, other layer, parameters) for each parameter two layers hold (tied embeddings)."""
    first: dict[int, int] = {}
    out = []
    for index, layer in enumerate(layers):
        for param in dict.fromkeys(layer.parameters()):
            if id(param) in first and first[id(param)] != index:
                out.append((first[id(param)], index, param.numel()))
            first.setdefault(id(param), index)
    return tuple(out)


def layer_tensors(layers: Sequence[nn.Module]) -> tuple[tuple[int, ...], ...]:
    """Each layer's parameter tensors, in elements (``ModelProfile.layer_tensors``; a tied tensor in each layer holding
    it, as each stage holding it steps its own copy)."""
    return tuple(tuple(p.numel() for p in dict.fromkeys(layer.parameters()) if p.requires_grad) for layer in layers)


def sample_microbatch(sample_batch: Any, micro_batch_size: int, device: torch.device) -> Any:
    """A profiling microbatch of ``micro_batch_size`` samples with every tensor (inputs *and* targets) on ``device``."""
    return to_device(resize_batch(sample_batch, micro_batch_size), device)


def measure_link(peer: int, device: torch.device, sizes: Sequence[int] = (256, 1 << 22)) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of messages between rank 0 and ``peer``; collective over the world.

    On a GPU a send returns once enqueued, so each round trip is timed with the device synchronised."""
    rank = dist.get_rank()
    results = []
    for size in sizes:
        buffer = torch.zeros(size // 4, dtype=torch.float32, device=device)
        times = []
        for _ in range(5):
            dist.barrier()
            synchronize(device)
            start = time.perf_counter()
            if rank == 0:
                dist.send(buffer, peer)
                dist.recv(buffer, peer)
            elif rank == peer:
                dist.recv(buffer, 0)
                dist.send(buffer, 0)
            synchronize(device)
            times.append((time.perf_counter() - start) / 2)
        results.append(statistics.median(times))
    latency = results[0]
    bandwidth = (sizes[1] - sizes[0]) / max(results[1] - results[0], 1e-9)
    message = [latency, bandwidth]
    dist.broadcast_object_list(message, src=0)
    return message[0], message[1]


def device_memory(device: torch.device, local_processes: int) -> float:
    """Memory a stage may plan for: what is free now (the CUDA context, other processes and what was allocated
    before the plan are not there to take), shared by the processes of a host on a CPU."""
    if device.type == "cuda":
        return float(torch.cuda.mem_get_info(device)[0])
    free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    return float(free / max(1, local_processes))


def plan_on_world(
    layers: Sequence[nn.Module],
    sample_batch: Any,
    input_fn: Callable[[Any], Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    device: torch.device,
    num_nodes: int,
    global_batch: int,
    run: Run,
    optimizer_states: int = 2,
    autocast: Callable[[], Any] | None = None,
    max_micro_sizes: int = 6,
) -> tuple[Prediction, ClusterSpec, list[Prediction]]:
    """The fastest plan that runs ``run`` (its options: mode, lookahead, delay correction; its precision: the bytes
    and dtypes the layers are profiled in, ``candidate.planning_run``) and fits, chosen on rank 0 from measured
    profiles, identical on every rank."""
    weight_dtype, boundary_dtype = run.weight_dtype, run.boundary_dtype  # the layers profiled as they will run
    weight_bytes, version_bytes = run.precision.parameter_bytes, run.precision.version_bytes(weight_dtype)
    world, rank = dist.get_world_size(), dist.get_rank()
    per_node = world // num_nodes
    latency, bandwidth = measure_link(1, device) if world > 1 else (0.0, float("inf"))
    inter_latency, inter_bandwidth = measure_link(per_node, device) if num_nodes > 1 else (latency, bandwidth)
    spec = DeviceSpec(f"{device.type}", 0.0, device_memory(device, per_node), 0.0)
    cluster = ClusterSpec(
        spec,
        num_nodes,
        per_node,
        bandwidth,
        inter_bandwidth * per_node,
        max(latency, inter_latency),
        name=f"this machine ({world} x {device.type})",
    )
    message: list[Any] = [None]
    if rank == 0:
        micros = [b for b in divisors(global_batch) if any((global_batch // w) % b == 0 for w in divisors(world))]
        micros = micros[:max_micro_sizes]
        shared = shared_layers(layers)

        def profile_for(micro: int) -> ModelProfile:
            batch = sample_microbatch(sample_batch, micro, device)
            profiles = measure_layers(
                layers,
                input_fn(batch),
                device,
                loss_fn=lambda out: loss_fn(out, batch),
                autocast=autocast,
                weight_dtype=weight_dtype,
                boundary_dtype=boundary_dtype,
            )
            nccl = NCCL_GROUP_BYTES if device.type == "cuda" else 0.0
            fused = 0.0 if device.type == "cuda" else None  # models/optim.py: fused AdamW on CUDA, no temporaries
            return ModelProfile(
                profiles,
                weight_bytes,
                optimizer_states,
                shared,
                version_bytes=version_bytes,
                communicator_bytes=nccl,
                optimizer_temporaries=fused,
                layer_tensors=layer_tensors(layers),
            )

        try:
            message = [search(profile_for, cluster, global_batch, run, micro_batch_sizes=micros)[0]]
        except ValueError as error:  # every rank raises it, none waits forever
            message = [error]
    dist.broadcast_object_list(message, src=0)
    if isinstance(message[0], Exception):
        raise message[0]
    fits = message[0]
    return fits[0], cluster, fits
