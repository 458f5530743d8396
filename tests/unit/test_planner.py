"""The planner's cost model on hand-computed cases, the search's constraints, its refusal and its speed (the layer
profiles: ``test_planner_profile.py``; ``pd2bw-plan`` itself: ``test_plan_cli.py``)."""

from __future__ import annotations

import pytest
import torch

from lightning_pd2bw.engine.options import PipelineOptions
from lightning_pd2bw.planner import Candidate, ClusterSpec, DeviceSpec, LayerProfile, NoPlanFits, predict, search
from lightning_pd2bw.planner.candidate import NCCL_PAIR_BYTES
from lightning_pd2bw.planner.cost import ModelProfile, allreduce_time, stage_memory
from lightning_pd2bw.planner.hardware import GiB, device_spec
from lightning_pd2bw.planner.profile import analytic_profile
from lightning_pd2bw.planner.search import partition

PLAIN = PipelineOptions(delay_correction=None)  # the run's options where a test weighs no correction's buffers
DEVICE = DeviceSpec("toy", peak_flops=1e12, memory_bytes=10 * GiB, memory_bandwidth=1e11)


def cluster(nodes: int = 1, per_node: int = 4, **kw) -> ClusterSpec:
    return ClusterSpec(
        kw.pop("device", DEVICE), nodes, per_node, kw.pop("intra", 1e10), kw.pop("inter", 1e9), latency=0.0
    )


def uniform(n: int = 4, forward: float = 1.0, params: int = 1000, act: float = 100.0, out: float = 0.0) -> ModelProfile:
    return ModelProfile([LayerProfile(forward, 2 * forward, act, out, params)] * n, weight_bytes=4, optimizer_states=2)


def test_pipeline_time_2bw_and_flush_by_hand():
    # 4 equal layers of F=1, B=2 on d=2: t = 2 * (1 + 2) = 6 s per microbatch and stage; m = 8
    profile, candidate = uniform(), Candidate.of(PipelineOptions(mode="2bw", delay_correction=None), 1, 2, 1, False)
    stages = [range(0, 2), range(2, 4)]
    two = predict(profile, candidate, cluster(), 8, stages)
    assert two.stage_times == (6.0, 6.0) and two.batch_time == pytest.approx(8 * 6.0)
    flush = predict(
        profile,
        Candidate.of(PipelineOptions(mode="flush", delay_correction=None), 1, 2, 1, False),
        cluster(),
        8,
        stages,
    )
    assert flush.batch_time == pytest.approx((8 + 2 - 1) * 6.0)  # (m + d - 1) t: the flush bubble
    assert two.throughput / flush.throughput == pytest.approx(9 / 8)
    recompute = predict(
        profile, Candidate.of(PipelineOptions(mode="2bw", delay_correction=None), 1, 2, 1, True), cluster(), 8, stages
    )
    assert recompute.stage_times == (8.0, 8.0), "recomputation repeats the forward: 4/3 of the compute"


def test_unequal_stages_flush_sums_the_stages():
    profile = ModelProfile([LayerProfile(1.0, 2.0, 0, 0, 1)] * 3)
    p = predict(
        profile,
        Candidate.of(PipelineOptions(mode="flush", delay_correction=None), 1, 2, 1, False),
        cluster(),
        4,
        [range(0, 2), range(2, 3)],
    )
    # the 1F1B timeline by hand (stage 0: F = 2, B = 4, one warm-up forward; stage 1: F = 1, B = 2), m = 4:
    # stage 0 runs F0 F1 [0, 4], waits for B0's gradient (stage 1: F0 [2, 3], B0 [3, 5]), then B0 [5, 9] F2 B1 F3
    # B2 B3 back to back, each gradient ready before it is needed: it ends at 25. The closed form
    # (m - 1) max t + sum t = 27 counted stage 1's idle slack as a bubble.
    assert p.stage_times == (6.0, 3.0) and p.batch_time == pytest.approx(25.0)


def test_boundary_messages_and_server_crossing():
    # activations of 1e9 bytes cross each boundary; inside a server 1e10 B/s, between servers 1e9 B/s shared by d
    profile = uniform(out=1e9)
    inside = predict(profile, Candidate.of(PLAIN, 1, 2, 1, False), cluster(per_node=4), 4, [range(0, 2), range(2, 4)])
    assert inside.stage_times[0] == pytest.approx(6.0 + 1e9 / 1e10)
    across = predict(
        profile, Candidate.of(PLAIN, 1, 2, 1, False), cluster(nodes=2, per_node=1), 4, [range(0, 2), range(2, 4)]
    )
    assert across.stage_times[0] == pytest.approx(6.0 + 1e9 / (1e9 / 1))


def test_allreduce_on_the_right_level():
    bytes_ = 1e9
    # 4 replicas of a 1-stage model in one server: ring over NVLink, 2 (w-1)/w bytes / bandwidth
    assert allreduce_time(
        bytes_, Candidate.of(PLAIN.replace(mode="flush"), 4, 1, 1, False), cluster(per_node=4)
    ) == pytest.approx(1.5 * bytes_ / 1e10)
    # 2 servers x 1 device: the ring crosses the network
    assert allreduce_time(
        bytes_, Candidate.of(PLAIN.replace(mode="flush"), 2, 1, 1, False), cluster(nodes=2, per_node=1)
    ) == pytest.approx(1.0 * bytes_ / 1e9)
    # width 1: nothing to reduce
    assert allreduce_time(bytes_, Candidate.of(PLAIN, 1, 4, 1, False), cluster()) == 0.0


EF = "error_feedback"


def test_the_delay_correction_is_in_the_plan():
    """2BW's error feedback keeps D(t-1), one copy of the stage's weights, and makes D(t) while it updates; the plan
    left it out (the gpt13b dry run printed the same memory with and without it)."""
    profile = uniform(n=4, params=1000, act=100.0, out=10.0)
    plain = stage_memory(
        profile, range(0, 2), 0, Candidate.of(PipelineOptions(mode="2bw", delay_correction=None), 1, 2, 1, False), 4
    )
    corrected = stage_memory(
        profile, range(0, 2), 0, Candidate.of(PipelineOptions(mode="2bw", delay_correction=EF), 1, 2, 1, False), 4
    )
    assert corrected["correction"] == 2000 * 4 and plain["correction"] == 0.0
    assert corrected["workspace"] - plain["workspace"] == 2000 * 4
    predictive = Candidate.of(PipelineOptions(mode="2bw", delay_correction="predictive_error_feedback"), 1, 2, 1, False)
    held = stage_memory(profile, range(0, 2), 0, predictive, 4)
    assert held["correction"] == 2 * 2000 * 4, "the predictive form holds D(t-1) and D(t-2)"
    assert held["workspace"] == corrected["workspace"]
    flush = stage_memory(
        profile, range(0, 2), 0, Candidate.of(PipelineOptions(mode="flush", delay_correction=EF), 1, 2, 1, False), 4
    )
    assert flush["correction"] == 0.0, "flush has no delay to correct"


def test_memory_per_stage_matches_the_paper_formula():
    # 2BW, no recompute: 2|W|/d weights + stash (d - s) x activations of the stage
    profile = uniform(n=4, params=1000, act=100.0, out=10.0)
    candidate = Candidate.of(PipelineOptions(mode="2bw", delay_correction=None), 1, 2, 1, False)
    first = stage_memory(profile, range(0, 2), 0, candidate, 4)
    assert first == {
        "weights": 2 * 2000 * 4,
        "gradients": 2 * 2000 * 4,  # batch b's, set aside until its STEP, beside batch b + 1's (issue 46)
        "optimizer": 2 * 2000 * 4,
        "activations": 2 * 200.0,
        "workspace": 100.0 + 2000 * 4,  # one layer's backward buffers; Adam's step temporaries while 2BW stashes
        "correction": 0.0,
        "outputs": 2 * 10.0,  # the stage's output of each stashed microbatch, kept for the backward
        "transport": (1 + 2) * 10.0,  # its warm-up send, one batched send and the gradient receive posted with it
        "communication": 4
        * NCCL_PAIR_BYTES,  # pairs at depth 2: the next stage, the pipeline's, the loss's, the world's
    }
    last = stage_memory(profile, range(2, 4), 1, candidate, 4)
    assert last["activations"] == 1 * 200.0
    assert last["outputs"] == 0.0 and last["transport"] == 2 * 10.0  # one gradient send, one activation receive
    # recompute: stash only the stage input (d - s of them), rebuild one microbatch's activations
    rec = stage_memory(
        profile, range(2, 4), 0, Candidate.of(PipelineOptions(mode="2bw", delay_correction=None), 1, 2, 1, True), 4
    )
    assert rec["activations"] == 2 * 10.0 + 200.0
    # flush keeps one weight version; GPipe stashes all m microbatches
    flush = stage_memory(
        profile, range(0, 2), 0, Candidate.of(PipelineOptions(mode="flush", delay_correction=None), 1, 2, 1, False), 4
    )
    assert flush["weights"] == 2000 * 4 and flush["workspace"] == 100.0, "flush steps with nothing stashed"
    assert flush["gradients"] == 2000 * 4, "flush completes its update at once: one gradient buffer"
    # m <= d - s: the whole stash is taken before the first backward; gradients then meet one microbatch fewer
    drained = stage_memory(
        profile, range(0, 2), 0, Candidate.of(PipelineOptions(mode="flush", delay_correction=None), 1, 2, 1, False), 2
    )
    assert drained["activations"] + drained["gradients"] == max(2 * 200.0, 200.0 + 2000 * 4)
    assert (
        stage_memory(
            profile,
            range(0, 2),
            0,
            Candidate.of(PipelineOptions(mode="gpipe", delay_correction=None), 1, 2, 1, False),
            4,
        )["activations"]
        == 4 * 200.0
    )


def test_lookahead_stashes_one_more_microbatch_on_every_stage():
    """lookahead=1 at d = 2, m = 4: stage 0 stashes d - s + 1 = 3 microbatches, the last stage 2 (it receives ahead); at m = 2 the
    cap (m - d = 0) leaves stage 0 at its 2, as the schedule runs it."""
    profile = uniform(n=4, params=1000, act=100.0, out=10.0)
    ahead = Candidate.of(PipelineOptions(mode="2bw", lookahead=1, delay_correction=None), 1, 2, 1, False)
    assert stage_memory(profile, range(0, 2), 0, ahead, 4)["activations"] == 3 * 200.0
    assert stage_memory(profile, range(2, 4), 1, ahead, 4)["activations"] == 2 * 200.0
    assert stage_memory(profile, range(0, 2), 0, ahead, 2)["activations"] == 2 * 200.0
    recompute = stage_memory(
        profile,
        range(2, 4),
        0,
        Candidate.of(PipelineOptions(mode="2bw", lookahead=1, delay_correction=None), 1, 2, 1, True),
        4,
    )
    assert recompute["activations"] == 3 * 10.0 + 200.0


def test_tied_parameter_counted_once_on_one_stage():
    profile = ModelProfile(
        [LayerProfile(1, 2, 0, 0, 500), LayerProfile(1, 2, 0, 0, 100), LayerProfile(1, 2, 0, 0, 500)],
        shared=((0, 2, 500),),
    )
    one = stage_memory(
        profile, range(0, 3), 0, Candidate.of(PipelineOptions(mode="flush", delay_correction=None), 1, 1, 1, False), 1
    )
    assert one["weights"] == (500 + 100 + 500 - 500) * 4


def test_partition_balances_time_not_layer_count():
    # an expensive head (the LM head's vocabulary matmul) gets a stage of its own
    layers = [LayerProfile(0.1, 0.2, 0, 0, 10)] + [LayerProfile(1, 2, 0, 0, 10)] * 4 + [LayerProfile(3, 6, 0, 0, 10)]
    stages = partition(ModelProfile(layers), Candidate.of(PLAIN, 1, 3, 1, False), 4, float("inf"))
    assert stages == [range(0, 3), range(3, 5), range(5, 6)]


def test_partition_respects_memory_and_shifts_layers_off_the_first_stage():
    # the first stage stashes d microbatches, the last one: memory pushes layers to the back
    layers = [LayerProfile(1, 2, 1000.0, 0, 0)] * 6
    profile = ModelProfile(layers, communicator_bytes=0.0)  # the stash alone (no NCCL buffers: gloo)
    balanced = partition(profile, Candidate.of(PLAIN, 1, 2, 1, False), 4, float("inf"))
    assert balanced == [range(0, 3), range(3, 6)]
    # stage 0: 2 stashed x 2 layers + one layer's backward workspace; stage 1: 1 x 4 layers + workspace
    tight = partition(profile, Candidate.of(PLAIN, 1, 2, 1, False), 4, capacity=2 * 2 * 1000.0 + 1000.0 + 1)
    assert tight == [range(0, 2), range(2, 6)]
    assert partition(profile, Candidate.of(PLAIN, 1, 2, 1, False), 4, capacity=1000.0) is None


def test_search_obeys_m_ge_d_and_ranks_by_throughput():
    fits, _ = search(lambda b: uniform(n=8), cluster(per_node=8), 16)
    assert fits and all(p.num_microbatches >= p.candidate.depth for p in fits)
    assert [p.throughput for p in fits] == sorted((p.throughput for p in fits), reverse=True)
    assert all(p.candidate.width * p.candidate.depth == 8 for p in fits)
    assert all(p.num_microbatches * p.candidate.micro_batch_size * p.candidate.width == 16 for p in fits)


def test_refusal_says_what_would_fit():
    device = device_spec("v100_16g")
    profiles = lambda b: ModelProfile(  # noqa: E731
        analytic_profile(num_blocks=40, hidden=5120, heads=40, vocab=50304, seq=2048, micro=b, device=device)
    )
    with pytest.raises(NoPlanFits) as error:
        search(profiles, cluster(device=device, per_node=8), 64)
    message = str(error.value)
    assert "nothing fits v100_16g" in message and "more devices" in message and "needs" in message


def test_search_over_1024_devices_does_bounded_work(monkeypatch):
    """1024 devices: each microbatch size profiled once, every candidate predicted once, and each candidate's cut
    found with a bounded number of greedy packings (the bisection's 40 steps + 1). How long it takes is a matter
    for a benchmark, not for a test (timings on a shared 2-core machine vary several-fold)."""
    import importlib

    search_module = importlib.import_module("lightning_pd2bw.planner.search")  # the package exports search()

    device = device_spec("a100_80g")
    profiled: list[int] = []

    def profile(b: int) -> ModelProfile:
        profiled.append(b)
        return ModelProfile(
            analytic_profile(num_blocks=40, hidden=5120, heads=40, vocab=50304, seq=2048, micro=b, device=device),
            shared=((0, 41, 50304 * 5120),),
        )

    packings = []
    original = search_module.pack
    monkeypatch.setattr(search_module, "pack", lambda *a, **k: packings.append(1) or original(*a, **k))
    fits, too_big = search(profile, ClusterSpec(device, 128, 8, 300e9, 200e9), 1024)
    candidates = search_module.candidates(1024, 42, 1024, PipelineOptions())
    per_stage = [f for f in fits if isinstance(f.candidate.recompute, tuple)]  # a refused one's fewest recomputed
    assert (
        fits and len(fits) - len(per_stage) + len(too_big) == len(candidates) >= 10 and len(per_stage) <= len(too_big)
    )
    assert sorted(profiled) == sorted(set(profiled)), "each microbatch size is profiled once"
    assert len(packings) <= 2 * 41 * len(candidates)  # a fitting cut, or a refused one and its unbounded cut


def test_the_optimizer_is_counted_per_layer_and_per_implementation():
    """Muon's one momentum buffer for the blocks' matrices against AdamW's two for the ends (``layer_states``), no
    step temporaries for fused AdamW (``optimizer_temporaries=0``), and the shares of a sharded optimizer."""
    layers = [LayerProfile(1.0, 2.0, 0.0, 0.0, 100)] * 4
    adam = ModelProfile(layers, weight_bytes=4, optimizer_states=2, communicator_bytes=0.0)
    muon = ModelProfile(
        layers, 4, 2, communicator_bytes=0.0, layer_states=(2.0, 1.0, 1.0, 2.0), optimizer_temporaries=0
    )
    candidate = Candidate.of(PipelineOptions(mode="2bw", delay_correction=None), 1, 2, 1, False)
    middle, end = range(1, 3), range(0, 2)
    assert stage_memory(adam, middle, 1, candidate, 2)["optimizer"] == 2 * 200 * 4
    assert stage_memory(muon, middle, 1, candidate, 2)["optimizer"] == 1 * 200 * 4
    assert stage_memory(muon, end, 0, candidate, 2)["optimizer"] == 1.5 * 200 * 4
    foreach, fused = stage_memory(adam, middle, 1, candidate, 2), stage_memory(muon, middle, 1, candidate, 2)
    assert foreach["workspace"] - fused["workspace"] == 200 * 4  # foreach AdamW's weight-sized temporaries
    sharded = Candidate.of(PipelineOptions(mode="2bw", delay_correction="error_feedback"), 4, 2, 1, False)
    whole = Candidate.of(
        PipelineOptions(mode="2bw", delay_correction="error_feedback", shard_optimizer=False), 4, 2, 1, False
    )
    a, b = stage_memory(adam, middle, 1, sharded, 2), stage_memory(adam, middle, 1, whole, 2)
    assert (a["optimizer"], a["correction"]) == (b["optimizer"] / 4, b["correction"] / 4)
    assert a["weights"] == b["weights"]  # float32 weights: no master beside them
    assert a["gradients"] == b["gradients"] * (1 + 1 / 4) / 2  # one buffer and a quarter of one aside (2BW)


def test_sharded_gradients_move_half_an_all_reduce():
    """Flush at width 4, 1 stage, optimizer time 0: the update is the replicas' exchange. Sharded optimizer:
    all-reduce + the owners' broadcast (1.5 all-reduces); with ``shard_gradients`` (the default) a reduce to the
    owners + the broadcast (one all-reduce's bytes, as DDP)."""
    profile = ModelProfile([LayerProfile(1.0, 2.0, 0.0, 0.0, 10**8)], weight_bytes=4, communicator_bytes=0.0)

    def update(**options) -> float:
        candidate = Candidate.of(PipelineOptions(mode="flush", **options), 4, 1, 1)
        return predict(profile, candidate, cluster(per_node=4), 4, [range(0, 1)]).update_time

    allreduce = allreduce_time(4e8, Candidate.of(PLAIN.replace(mode="flush"), 4, 1, 1, False), cluster(per_node=4))
    reads = 2 * 4e8 / DEVICE.memory_bandwidth  # the gradients read for the non-finite flags and the clip norm
    assert update(shard_optimizer=False) == pytest.approx(allreduce + reads)
    assert update(shard_gradients=False) == pytest.approx(1.5 * allreduce + reads)
    assert update() == update(shard_gradients=True) == pytest.approx(allreduce + reads)  # the default since 0.13.0


def test_nccl_communicators_are_those_the_stage_joins():
    """Issue 47: the world group counts on every stage; the tied parameters' group only on the stages holding a
    parameter another stage holds (GPT's embedding and head), not on the middle ones; the sharded optimizer's own."""
    from lightning_pd2bw.planner.cost import communication_bytes, communicators

    layers = [LayerProfile(1.0, 2.0, 0.0, 0.0, 10)] * 6
    profile = ModelProfile(layers, shared=((0, 5, 10),))
    sharded = Candidate.of(PipelineOptions(mode="2bw"), 2, 3, 1, False)
    whole = Candidate.of(PipelineOptions(mode="2bw", shard_optimizer=False), 2, 3, 1, False)
    # first: next, pipeline, loss, replica, shard, tied, world; middle: both neighbours, no tied; last: like the first
    assert [communicators(profile, s, sharded, span) for s, span in enumerate(S3)] == [
        [2, 3, 3, 2, 2, 2, 6],
        [2, 2, 3, 3, 2, 2, 6],
        [2, 3, 3, 2, 2, 2, 6],
    ]
    assert [len(communicators(profile, s, whole, span)) for s, span in enumerate(S3)] == [6, 6, 6]
    alone = Candidate.of(PipelineOptions(mode="2bw"), 1, 3, 1, False)
    assert [communicators(profile, s, alone, span) for s, span in enumerate(S3)] == [
        [2, 3, 3, 2, 3],
        [2, 2, 3, 3, 3],
        [2, 3, 3, 2, 3],
    ]
    # NCCL's buffers by size (NVIDIA/nccl#964's measurement): a pair 544 MB, a larger group 688 MB, one rank none
    assert communication_bytes(profile, [2, 3, 1, 6]) == 544e6 + 688e6 + 688e6
    assert communication_bytes(ModelProfile(layers, communicator_bytes=0.0), [2, 3]) == 0.0  # gloo


S3 = (range(0, 2), range(2, 4), range(4, 6))


@pytest.mark.parametrize("mode,versions", [("2bw", 2), ("flush", 1)])
def test_mixed_precision_weights_hold_bfloat16_versions_and_one_float32_master(mode, versions):
    """``weight_dtype`` (bfloat16 under bf16-mixed): each version in 2 bytes per parameter and one float32 master;
    gradients, optimizer state and the correction stay float32. Equal to two float32 versions under 2BW, one master
    more (2 bytes per parameter) under flush."""
    from lightning_pd2bw.engine.precision import Precision

    layers = [LayerProfile(1.0, 2.0, 0.0, 0.0, 100)] * 4
    plain = ModelProfile(layers, weight_bytes=4, communicator_bytes=0.0)
    mixed = ModelProfile(layers, weight_bytes=4, version_bytes=2, communicator_bytes=0.0)
    candidate = Candidate.of(PipelineOptions(mode=mode), 1, 2, 1, False)
    a, b = stage_memory(mixed, range(1, 3), 1, candidate, 2), stage_memory(plain, range(1, 3), 1, candidate, 2)
    assert a["weights"] == versions * 200 * 2 + 200 * 4 and b["weights"] == versions * 200 * 4
    assert {k: v for k, v in a.items() if k != "weights"} == {k: v for k, v in b.items() if k != "weights"}
    mixed, full = Precision.of("bf16-mixed"), Precision.of("32-true")
    assert mixed.version_bytes(torch.bfloat16) == 2 and full.version_bytes(torch.float32) is None
    assert mixed.version_bytes(None) is None and full.version_bytes("bfloat16") == 2
    assert Precision.of("bf16-true").version_bytes(torch.bfloat16) is None  # the weights are the versions


def test_the_fullest_replica_steps_the_largest_tensor_whole():
    """Issue 62: the sharded optimizer's owners take whole tensors (``sharding.assign_owners``), so a stage whose
    largest tensor exceeds 1/w of it (GPT's embedding on stage 0) has a replica stepping more than 1/w. By hand:
    tensors of 100, 20 and 20 elements on 2 replicas: 100 to one, both 20s to the other; the fullest steps 100/140."""
    layers = [LayerProfile(1.0, 2.0, 0.0, 0.0, 100), LayerProfile(1.0, 2.0, 0.0, 0.0, 40)]
    balanced = ModelProfile(layers, weight_bytes=4)
    whole = ModelProfile(layers, weight_bytes=4, layer_tensors=((100,), (20, 20)))
    candidate = Candidate.of(PipelineOptions(mode="flush"), 2, 1, 1, False)
    assert candidate.replica_share(balanced, range(0, 2)) == pytest.approx(1 / 2)
    assert candidate.replica_share(whole, range(0, 2)) == pytest.approx(100 / 140)
    even, fullest = (
        stage_memory(balanced, range(0, 2), 0, candidate, 2),
        stage_memory(whole, range(0, 2), 0, candidate, 2),
    )
    assert fullest["optimizer"] == pytest.approx(even["optimizer"] * (100 / 140) / (1 / 2))
    unsharded = Candidate.of(PipelineOptions(mode="flush", shard_optimizer=False), 2, 1, 1, False)
    assert unsharded.replica_share(whole, range(0, 2)) == 1.0
