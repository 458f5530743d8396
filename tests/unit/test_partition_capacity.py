"""The planner's cut never admits a stage its own memory model says is over capacity: the cut (``search.pack``)
counts the fullest replica's optimizer share as ``cost.stage_memory`` does (owners take whole tensors, so the one
holding a large tensor steps more than 1/w of the stage). Before 0.14.0 the cut counted 1/w, and the 13B table listed
a 72.7 GiB stage as fitting 72 GiB."""

from __future__ import annotations

from lightning_pd2bw.engine.options import PipelineOptions
from lightning_pd2bw.planner import Candidate, LayerProfile
from lightning_pd2bw.planner.cost import ModelProfile, stage_memory
from lightning_pd2bw.planner.search import partition


def test_every_stage_of_a_cut_fits_the_capacity_it_was_cut_for():
    layers = [LayerProfile(1.0, 2.0, 10.0, 0.0, 10_000)] + [LayerProfile(1.0, 2.0, 10.0, 0.0, 1_000)] * 5
    tensors = ((9_000, 1_000),) + ((500, 500),) * 5  # an embedding-like tensor: its owner steps most of stage 0
    profile = ModelProfile(layers, weight_bytes=4, optimizer_states=2, layer_tensors=tensors, communicator_bytes=0)
    candidate = Candidate.of(PipelineOptions(mode="flush", delay_correction=None), 2, 2, 1, False)
    full = sum(stage_memory(profile, range(6), 0, candidate, 4).values())
    cut = 0
    for capacity in [full * k / 400 for k in range(100, 401)]:
        stages = partition(profile, candidate, 4, capacity)
        if stages is None:
            continue
        cut += 1
        for s, span in enumerate(stages):
            assert sum(stage_memory(profile, span, s, candidate, 4).values()) <= capacity, (capacity, stages)
    assert cut > 50  # many capacities tried admit a cut
