"""What a search simulates (issue 97, item 6: ``pd2bw-plan`` at 13B in seconds): the fastest plan (any schedule's) and a
table's rows found from the lowest bound up equal the full search's; the layouts that do not fit are timed only where shown;
a second search of the same model re-simulates nothing. The figures are the full search's (``--check`` of the
generated plan pages holds them to the digit)."""

from __future__ import annotations

import importlib
import math

import pytest

from lightning_pd2bw.engine.options import PipelineOptions
from lightning_pd2bw.planner import ClusterSpec, search
from lightning_pd2bw.planner.cost import ModelProfile, compute_time
from lightning_pd2bw.planner.hardware import device_spec
from lightning_pd2bw.planner.profile import analytic_profile
from lightning_pd2bw.planner.search import TIMED_TOO_BIG

DEVICE = device_spec("a100_80g")
CLUSTER = ClusterSpec(DEVICE, 4, 8, 300e9, 100e9)  # 32 devices: a 13B-sized model fits only some layouts


def profile(micro: int) -> ModelProfile:
    layers = analytic_profile(num_blocks=40, hidden=5120, heads=40, vocab=50304, seq=2048, micro=micro, device=DEVICE)
    return ModelProfile(layers, shared=((0, 41, 50304 * 5120),))


def counted(monkeypatch) -> list[int]:
    """Each simulation the search runs (``cost.timing``)."""
    cost = importlib.import_module("lightning_pd2bw.planner.cost")
    calls: list[int] = []
    original = cost.timing
    monkeypatch.setattr(cost, "timing", lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


@pytest.mark.parametrize("mode", ["flush", "zb_h1", "2bw"])
def test_the_fastest_plan_is_the_full_searchs(monkeypatch, mode):
    calls = counted(monkeypatch)
    options = PipelineOptions(mode=mode)
    fits, _ = search(profile, CLUSTER, 512, options)
    everything = len(calls)
    fastest, _ = search(profile, CLUSTER, 512, options, fastest_only=True)
    assert len(fastest) == 1 and fastest[0].throughput == fits[0].throughput
    assert fastest[0].candidate.depth == fits[0].candidate.depth
    assert len(calls) - everything < everything / 2, "the bound leaves most candidates unsimulated"


@pytest.mark.parametrize("mode", ["flush", "2bw"])
def test_a_tables_rows_are_the_full_searchs_and_every_step_is_above_its_bound(monkeypatch, mode):
    """``top=k`` (``pd2bw-plan``'s table): the k fastest timed, the same as the full search's, the others that fit
    listed untimed; the bound the search skips by holds for every simulated step (2BW's steady state included)."""
    calls = counted(monkeypatch)
    options = PipelineOptions(mode=mode)
    fits, _ = search(profile, CLUSTER, 512, options)
    everything = len(calls)
    table, _ = search(profile, CLUSTER, 512, options, top=5)
    assert [(p.candidate, p.throughput) for p in table[:5]] == [(p.candidate, p.throughput) for p in fits[:5]]
    assert len(table) == len(fits) and all(math.isnan(p.batch_time) for p in table[5:])
    assert len(calls) - everything < everything, "the bound leaves candidates unsimulated"
    for p in fits:
        m = p.num_microbatches
        bound = max(
            m * sum(compute_time(profile(p.candidate.micro_batch_size), p.candidate, s, span))
            for s, span in enumerate(p.stages)
        )
        assert p.batch_time >= bound, p.candidate


def test_only_the_closest_layouts_that_do_not_fit_are_timed(monkeypatch):
    calls = counted(monkeypatch)
    fits, too_big = search(profile, CLUSTER, 512, PipelineOptions(mode="2bw"))
    assert len(too_big) > TIMED_TOO_BIG and len(calls) == len(fits) + TIMED_TOO_BIG
    assert [p.peak_memory for p in too_big] == sorted(p.peak_memory for p in too_big)
    assert all(p.throughput > 0 for p in too_big[:TIMED_TOO_BIG])
    assert all(math.isnan(p.batch_time) for p in too_big[TIMED_TOO_BIG:])


def test_a_second_search_of_the_same_model_simulates_nothing_again(monkeypatch):
    calls = counted(monkeypatch)
    predicted: dict = {}
    first, _ = search(profile, CLUSTER, 512, PipelineOptions(mode="2bw", placement="replicas"), predicted=predicted)
    before = len(calls)
    again, _ = search(profile, CLUSTER, 512, PipelineOptions(mode="2bw", placement="replicas"), predicted=predicted)
    assert len(calls) == before and [p.throughput for p in again] == [p.throughput for p in first]
    free, _ = search(profile, CLUSTER, 512, PipelineOptions(mode="2bw"), predicted=predicted)
    shared = {repr(p.candidate) for p in first} & {repr(p.candidate) for p in free}
    assert shared and len(calls) - before <= len(free) + TIMED_TOO_BIG - len(shared)


def test_the_embedding_owner_holds_adamws_two_states_beside_muons_one():
    """Issue 95: Muon steps the blocks' matrices (one state), AdamW the embedding (two). By hand, tensors of 100 (the
    embedding, AdamW) and 4 x 30 (Muon) on 2 replicas, owned by elements as the engine assigns them (100 to one,
    the four 30s to the other): the embedding's owner holds 200 states, the other 120; the stage's optimizer term is
    the fullest's 200 states x 4 bytes, where averaging the states over the stage (1.45 each) and taking the fullest
    share of elements (120/220) would count 174.5."""
    from lightning_pd2bw.planner import Candidate, LayerProfile
    from lightning_pd2bw.planner.cost import stage_memory

    layers = [LayerProfile(1.0, 2.0, 0.0, 0.0, 100), LayerProfile(1.0, 2.0, 0.0, 0.0, 120)]
    profile = ModelProfile(layers, weight_bytes=4, layer_states=(2.0, 1.0), layer_tensors=((100,), (30, 30, 30, 30)))
    candidate = Candidate.of(PipelineOptions(mode="flush"), 2, 1, 1, False)
    assert candidate.replica_share(profile, range(0, 2)) == pytest.approx(120 / 220)
    assert stage_memory(profile, range(0, 2), 0, candidate, 2)["optimizer"] == pytest.approx(200 * 4)
