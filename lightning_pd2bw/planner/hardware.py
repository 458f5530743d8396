"""Devices and clusters the planner plans for: compute, memory and the two levels of the network.

A cluster is ``num_nodes`` servers of ``devices_per_node`` devices. Inside a server devices talk
over NVLink/NVSwitch (``intra_node_bandwidth``, bytes/s per device); servers talk over the network
(``inter_node_bandwidth``, bytes/s per server, shared by its devices). Cluster presets live in
``conf/cluster/*.yaml``; device figures are vendor datasheet numbers (dense, no sparsity).
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9
GiB = 1024**3


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_flops: float  # dense matmul FLOP/s in the training precision (bf16/fp16 tensor cores)
    memory_bytes: float  # capacity
    memory_bandwidth: float  # bytes/s (HBM): bounds embeddings, norms, optimizer steps
    efficiency: float = 0.45  # achieved fraction of peak on transformer layers (model FLOPs utilisation)


# Datasheet figures. V100 SXM2: 125 TFLOP/s fp16 tensor, 900 GB/s; A100 SXM4 80GB: 312 TFLOP/s bf16,
# 2.04 TB/s; H100 SXM5: 989 TFLOP/s bf16 dense, 3.35 TB/s.
DEVICES: dict[str, DeviceSpec] = {
    "v100_16g": DeviceSpec("v100_16g", 125e12, 16 * GiB, 900 * GB, efficiency=0.35),
    "a100_80g": DeviceSpec("a100_80g", 312e12, 80 * GiB, 2039 * GB),
    # measured: a GPT-13B stage slice (embedding, 5 blocks of 5120, head; micro 1, m = 8, recomputation off, eager)
    # trained by the engine at 45.8% MFU under 2BW and 48.0% under Flush, the whole step with its update, on one
    # H200 (the H100 SXM's tensor cores and clocks) on 2026-11-27 (docs/gpus-log.md; benchmarks/gpu_stage.py --model
    # gpt13b --layers 5 --micro 1 --m 8 --lookahead 7 --runs 2bw,flush)
    "h100_80g": DeviceSpec("h100_80g", 989e12, 80 * GiB, 3350 * GB, efficiency=0.46),
}


def device_spec(name: str) -> DeviceSpec:
    if name not in DEVICES:
        raise ValueError(f"unknown device {name!r}; valid: {', '.join(sorted(DEVICES))}")
    return DEVICES[name]


@dataclass(frozen=True)
class ClusterSpec:
    device: DeviceSpec
    num_nodes: int
    devices_per_node: int
    intra_node_bandwidth: float  # bytes/s between two devices of one server
    inter_node_bandwidth: float  # bytes/s out of one server (all its NICs together)
    latency: float = 2e-5  # seconds per message
    name: str = "cluster"

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    def describe(self) -> str:
        d = self.device
        return (
            f"{self.name}: {self.num_nodes} x {self.devices_per_node} {d.name} ({d.memory_bytes / GiB:.0f} GiB, "
            f"{d.peak_flops / 1e12:.0f} TFLOP/s x {d.efficiency:.0%}), "
            f"{self.intra_node_bandwidth / GB:.0f} GB/s inside a server, {self.inter_node_bandwidth / GB:.1f} GB/s "
            "between servers"
        )
