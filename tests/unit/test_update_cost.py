"""What the update's collectives add to a step (``timing.update_cost``, the ``update:`` line of ``pd2bw-plan``) and
``grad_reduce_dtype`` in the planner, against hand-computed costs: Flush at depth 1 and width 2, one bucket, no
latency, so every collective is exposed and costs its ring's bytes over the link."""

from __future__ import annotations

import pytest

from lightning_pd2bw.engine.options import PipelineOptions
from lightning_pd2bw.engine.updates.gradients import replica_bucket_bytes
from lightning_pd2bw.planner import Candidate, ClusterSpec, DeviceSpec, LayerProfile
from lightning_pd2bw.planner.cost import ModelProfile, allreduce_time, stage_memory
from lightning_pd2bw.planner.hardware import GiB
from lightning_pd2bw.planner.timing import update_cost, update_shape

DEVICE = DeviceSpec("toy", peak_flops=1e12, memory_bytes=10 * GiB, memory_bandwidth=0)  # the reads not counted
CLUSTER = ClusterSpec(DEVICE, 1, 4, 1e10, 1e9, latency=0.0)
PARAMS = 4 * 1000  # 4 layers of 1000


def profile() -> ModelProfile:
    return ModelProfile([LayerProfile(1.0, 2.0, 100.0, 0.0, 1000)] * 4, weight_bytes=4, optimizer_states=2)


def flush(**options) -> Candidate:
    return Candidate.of(PipelineOptions(mode="flush", delay_correction=None, **options), 2, 1, 1, False)


@pytest.mark.parametrize("reduce_dtype, travels", [(None, 4), ("bfloat16", 2)])
def test_flush_pays_each_collective_whole_and_bf16_halves_the_reduce(reduce_dtype, travels):
    candidate = flush(grad_reduce_dtype=reduce_dtype)
    added = update_cost(profile(), candidate, CLUSTER, [range(4)], 2)
    # the gradients reduced to the two owners: half an all-reduce's ring, in the bytes they travel in
    assert added["gradient reduce"] == pytest.approx(allreduce_time(PARAMS * travels, candidate, CLUSTER) / 2)
    # each owner's new float32 weights to the other replica: half an all-reduce's ring of the weights
    assert added["weight broadcasts"] == pytest.approx(allreduce_time(PARAMS * 4, candidate, CLUSTER) / 2)
    assert added["tied weights"] == 0.0
    assert added["all"] == pytest.approx(added["gradient reduce"] + added["weight broadcasts"])
    assert added["step"] == pytest.approx(2 * 3.0 * 4 + added["all"])  # m = 2 of (F + B) x 4 layers, then the update


def test_a_bf16_reduce_counts_its_copy_and_the_buckets_follow_megatron():
    plain, bf16 = flush(), flush(grad_reduce_dtype="bfloat16")
    grads = [stage_memory(profile(), range(4), 0, c, 2)["gradients"] for c in (plain, bf16)]
    assert grads[1] - grads[0] == PARAMS * 2  # the bf16 copy of every bucket, in flight at once
    half = ModelProfile([LayerProfile(1.0, 2.0, 100.0, 0.0, 1000)] * 4, weight_bytes=2)  # bf16-true gradients
    up = [stage_memory(half, range(4), 0, c, 2)["gradients"] for c in (plain, flush(grad_reduce_dtype="float32"))]
    assert up[1] - up[0] == PARAMS * 4  # cast up: a float32 copy travels (the engine casts whenever dtypes differ)
    assert replica_bucket_bytes(16) == 40_000_000 * 4 and replica_bucket_bytes(64, 2) == 64_000_000 * 2
    big = ModelProfile([LayerProfile(1.0, 2.0, 100.0, 0.0, 30_000_000)] * 4, weight_bytes=4)
    assert update_shape(big, plain, range(4)).buckets == 3  # 120M float32 gradients in buckets of 40M
