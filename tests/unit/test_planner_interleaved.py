"""The planner's interleaved 1F1B comparator (``planner/interleaved.py``) against hand-computed figures: its step on
equal layers with free messages is Megatron-LM's ``(m + (d - 1) / V) (F + B)`` and Flush's the plain 1F1B one, each
rank holds all its chunks' weights, and its peak activations are its warm-up's chunk-microbatches plus one."""

from __future__ import annotations

import pytest

from lightning_pd2bw.engine.options import PipelineOptions
from lightning_pd2bw.planner.candidate import Candidate, ModelProfile
from lightning_pd2bw.planner.cost import predict
from lightning_pd2bw.planner.hardware import ClusterSpec, DeviceSpec
from lightning_pd2bw.planner.interleaved import chunks_of, predict_interleaved, warmup_chunks
from lightning_pd2bw.planner.profile import LayerProfile

LAYERS = 16
FORWARD, BACKWARD, ACTIVATIONS, PARAMETERS = 0.01, 0.02, 1000.0, 100


def setting(depth: int, micro_batches: int):
    layer = LayerProfile(FORWARD, BACKWARD, ACTIVATIONS, 0.0, PARAMETERS)
    profile = ModelProfile([layer] * LAYERS, communicator_bytes=0.0)
    # no memory bandwidth (the gradients' reads not counted), free messages
    cluster = ClusterSpec(DeviceSpec("toy", 1e12, 1 << 40, 0.0), 1, depth, 1e30, 1e30, latency=0.0)
    options = PipelineOptions(mode="flush")
    return profile, cluster, Candidate.of(options, 1, depth, 1), micro_batches


@pytest.mark.parametrize("depth,m,virtual", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (2, 8, 4)])
def test_the_step_is_megatrons_and_flushs_is_1f1bs(depth, m, virtual):
    profile, cluster, candidate, m = setting(depth, m)
    per_stage = (FORWARD + BACKWARD) * LAYERS / depth
    flush = predict(profile, candidate, cluster, m, chunks_of(profile, depth))
    interleaved = predict_interleaved(profile, candidate, cluster, m, virtual)
    assert flush.batch_time == pytest.approx((m + depth - 1) * per_stage, rel=1e-6)
    assert interleaved.batch_time == pytest.approx((m + (depth - 1) / virtual) * per_stage, rel=1e-6)
    assert len(interleaved.stages) == depth * virtual


def test_a_rank_holds_its_chunks_and_its_warm_up_in_flight():
    profile, cluster, candidate, m = setting(4, 8)
    flush = predict(profile, candidate, cluster, m, chunks_of(profile, 4))
    interleaved = predict_interleaved(profile, candidate, cluster, m, 2)
    for rank in range(4):
        ours, theirs = interleaved.stage_memory[rank], flush.stage_memory[rank]
        assert ours["weights"] == theirs["weights"] and ours["optimizer"] == theirs["optimizer"]
        # (V - 1) P + 2 (d - 1 - r) warm-up forwards of a chunk (2 layers), and the one whose backward comes next
        assert warmup_chunks(rank, 4, 8, 2) == 4 + 2 * (3 - rank)
        assert ours["activations"] == (warmup_chunks(rank, 4, 8, 2) + 1) * 2 * ACTIVATIONS
    assert interleaved.peak_memory > flush.peak_memory  # rank 0: 11 chunk-microbatches against 1F1B's 4 stages'


def test_layouts_it_cannot_run_are_none():
    profile, cluster, candidate, _ = setting(4, 8)
    assert predict_interleaved(profile, candidate, cluster, 9, 2) is None  # 9 microbatches in two rounds
    assert predict_interleaved(profile, candidate, cluster, 8, 5) is None  # 20 chunks of 16 layers


def test_the_search_names_where_interleaved_is_planned():
    """``plan="auto"`` and ``pd2bw-plan`` search layouts for the other modes; an interleaved run is told where its plan
    is printed (the synchronous plans' line) and to give its layout."""
    from lightning_pd2bw.planner.search import candidates

    with pytest.raises(ValueError, match="synchronous plans' line .* give an interleaved run its layout"):
        candidates(8, 16, 64, PipelineOptions(mode="interleaved"))
