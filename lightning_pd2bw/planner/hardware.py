"""Devices and clusters the planner plans for: compute, memory and the two levels of the network.

A cluster is ``num_nodes`` servers of ``devices_per_node`` devices. Inside a server devices talk
over NVLink/NVSwitch (``intra_node_bandwidth``, bytes/s per device); servers talk over the network
(``inter_node_bandwidth``, bytes/s per server, shared by its devices). Cluster presets live in
``conf/cluster/*.yaml``; device figures are vendor datasheet numbers (dense, no sparsity), and the two achieved
fractions (``efficiency`` of the tensor cores, ``memory_efficiency`` of the memory) are measured
(``planner/profile.py`` turns them into a roofline per GEMM shape and per memory pass).
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
    memory_bandwidth: float  # bytes/s (HBM): bounds embeddings, norms, casts, optimizer steps, small GEMMs
    # achieved fraction of peak by a GEMM whose output tiles fill every multiprocessor's last wave (attention alike)
    efficiency: float = 0.8
    memory_efficiency: float = 1.0  # achieved fraction of ``memory_bandwidth`` by streaming kernels
    # streaming multiprocessors: a GEMM's output tiles run in waves of this many, the last one partly idle (0: not
    # modelled, every GEMM at ``efficiency``)
    multiprocessors: int = 0
    # activation-sized memory passes of one block's elementwise work per microbatch, forward and backward together
    # (norms, GELU, residual adds, casts; a third in the forward): measured with the kernel mix (0: not counted)
    elementwise_passes: float = 0.0


# Datasheet figures. V100 SXM2: 125 TFLOP/s fp16 tensor, 900 GB/s, 80 SMs; A100 SXM4 80GB: 312 TFLOP/s bf16,
# 2.04 TB/s, 108 SMs; H100 SXM5: 989 TFLOP/s bf16 dense, 3.35 TB/s, 132 SMs; H200: the H100's tensor cores and
# clocks with 141 GB at 4.8 TB/s.
# Measured on one H200 (2026-11-27, docs/gpus-log.md): the kernel profile of one microbatch of 2 GPT-13B blocks at
# micro 1 plus a fused AdamW step (19.3 ms of kernels: GEMMs and attention 10.2 ms for 8.25e12 FLOPs, 0.91 of peak
# with the last waves counted; the optimizer's 28 bytes per parameter at 0.73 of the bandwidth) splits the time
# between the tensor cores and the memory, and the 13B stage slice's whole step under Flush (embedding, 5 blocks,
# head, 8 microbatches of 1 and the update: 0.400 s) sets the level: the kernels ran 0.87 of the step, so both
# fractions are the kernels' x 0.87, launch gaps and all; the elementwise kernels' 4.03 ms, less the float32 gradient
# accumulation counted apart, are 185 activation-sized passes per block at that bandwidth (tests/unit/test_planner_roofline.py reproduces both).
# The A100 takes the H200's fractions until measured.
MEASURED = {"efficiency": 0.79, "memory_efficiency": 0.63, "elementwise_passes": 185}
DEVICES: dict[str, DeviceSpec] = {
    # not measured: the tensor cores' fraction keeps a GPT-2.2B block at micro 4 at the 0.35 of peak the V100 was
    # planned at before the roofline (0.16.0)
    "v100_16g": DeviceSpec(
        "v100_16g",
        125e12,
        16 * GiB,
        900 * GB,
        efficiency=0.5,
        memory_efficiency=0.63,
        multiprocessors=80,
        elementwise_passes=185,
    ),
    "a100_80g": DeviceSpec("a100_80g", 312e12, 80 * GiB, 2039 * GB, **MEASURED, multiprocessors=108),
    "h100_80g": DeviceSpec("h100_80g", 989e12, 80 * GiB, 3350 * GB, **MEASURED, multiprocessors=132),
    "h200_141g": DeviceSpec("h200_141g", 989e12, 140 * GiB, 4800 * GB, **MEASURED, multiprocessors=132),
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
            f"{d.peak_flops / 1e12:.0f} TFLOP/s, GEMMs at {d.efficiency:.0%} of a full wave, "
            f"{d.memory_bandwidth / GB:.0f} GB/s at {d.memory_efficiency:.0%}), "
            f"{self.intra_node_bandwidth / GB:.0f} GB/s inside a server, {self.inter_node_bandwidth / GB:.1f} GB/s "
            "between servers"
        )
