"""Recomputation per stage (issue 62, 2): ``recompute`` takes, per stage, how many of its first layers recompute
their activations in the backward (Megatron's ``recompute_num_layers``, chosen per stage); the engine runs it with
the gradients of no recomputation, keeping fewer activations; the planner chooses the fewest that fit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pd2bw.engine.comm.transport import StageLink
from lightning_pd2bw.engine.executor import StageExecutor
from lightning_pd2bw.engine.layout import Layout
from lightning_pd2bw.engine.options import PipelineOptions, recomputed_layers
from lightning_pd2bw.engine.schedules import schedule as S
from lightning_pd2bw.engine.state.versions import WeightVersions
from lightning_pd2bw.observe.activations import ActivationMeter
from lightning_pd2bw.planner import Candidate, LayerProfile
from lightning_pd2bw.planner.cost import ModelProfile, stage_memory
from lightning_pd2bw.planner.search import fewest_recomputed, partition

from ..stage_update import local_update

WIDTH, M = 32, 4


def test_recompute_takes_true_false_or_a_count_per_stage():
    assert PipelineOptions(recompute=[2, 0]).recompute == (2, 0)
    assert PipelineOptions(num_stages=2, recompute=(1, 1)).resolve(2).options.recompute == (1, 1)
    with pytest.raises(ValueError, match=r"\(recompute=\[1, 0, 0\]\) needs one entry per stage \(num_stages=2\)"):
        PipelineOptions(num_stages=2, recompute=[1, 0, 0])
    with pytest.raises(ValueError, match=r"\(recompute=\[1\]\) needs one entry per stage: 2 stages here"):
        PipelineOptions(recompute=[1]).resolve(2)
    for bad in ([-1, 0], [1.5, 0], "yes"):
        with pytest.raises(ValueError, match="per stage the number of its first layers"):
            PipelineOptions(recompute=bad)
    assert [recomputed_layers(r, 1, 3) for r in (True, False, (0, 2), (0, 9))] == [3, 0, 2, 3]
    from omegaconf import OmegaConf  # what pd2bw-train's `strategy.recompute=[2,1]` hands the strategy

    assert PipelineOptions(recompute=OmegaConf.create([2, 1])).recompute == (2, 1)


def run_stage(recompute: bool | tuple[int, ...]) -> tuple[list[torch.Tensor], int]:
    """One stage of four layers through a flush batch: its gradients and the activation meter's peak."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(4)])
    versions = WeightVersions(model.parameters(), double_buffer=False)
    grads: list[torch.Tensor] = []
    executor = StageExecutor(
        list(model),
        0,
        Layout(1, M, "flush"),
        StageLink(None, None, torch.device("cpu")),
        versions,
        input_fn=lambda mb: mb["x"],
        loss_fn=lambda out, mb: (out - mb["y"]).pow(2).mean(),
        options=PipelineOptions(recompute=recompute, boundary_dtype=None),
        handlers=local_update(versions, lambda batch: grads.extend(p.grad.clone() for p in model.parameters())),
    )
    executor.meter = ActivationMeter(model.parameters())
    torch.manual_seed(1)
    executor.feed(0, [{"x": torch.randn(16, WIDTH), "y": torch.randn(16, WIDTH)} for _ in range(M)])
    executor.run(S.segment(Layout(1, M, "flush"), 0, 0))
    return grads, executor.meter.peak


def test_the_first_layers_recompute_with_the_same_gradients_and_fewer_activations():
    plain, none_peak = run_stage(False)
    peaks = [none_peak]
    for recompute in ((1,), (3,), True):
        grads, peak = run_stage(recompute)
        for got, expected in zip(grads, plain, strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)  # the same ops, the same order: bitwise
        peaks.append(peak)
    # flush at d=1 holds one microbatch at a time: each recomputed layer keeps its input only
    assert peaks[0] > peaks[1] > peaks[2] > peaks[3], peaks


def uniform(layers: int = 16, activations: float = 1000.0) -> ModelProfile:
    return ModelProfile([LayerProfile(1.0, 2.0, activations, 10.0, 10) for _ in range(layers)], communicator_bytes=0)


def test_the_planner_recomputes_the_fewest_layers_that_fit_on_each_stage():
    """Stage s stashes min(d - s, m) microbatches: with 4 stages of 4 layers the first stage needs the most."""
    profile = uniform()
    plain = Candidate.of(PipelineOptions(mode="flush", delay_correction=None), 1, 4, 1, False)
    stages = partition(profile, plain, 4, float("inf"))
    needs = [sum(stage_memory(profile, span, s, plain, 4).values()) for s, span in enumerate(stages)]
    capacity = 9000.0  # the last stage fits as it is; the first three do not
    assert needs[-1] <= capacity < min(needs[:-1])
    chosen = fewest_recomputed(profile, plain, 4, capacity, stages)
    assert chosen is not None and chosen.recompute[-1] == 0 and chosen.recompute[0] > 0
    assert list(chosen.recompute) == sorted(chosen.recompute, reverse=True) and len(set(chosen.recompute)) > 2
    for s, span in enumerate(stages):
        count = chosen.recompute[s]
        fits = sum(stage_memory(profile, span, s, chosen, 4).values())
        assert fits <= capacity
        if count:  # one fewer does not fit: the fewest
            fewer = Candidate.of(plain.options, 1, 4, 1, tuple(c - (i == s) for i, c in enumerate(chosen.recompute)))
            assert sum(stage_memory(profile, span, s, fewer, 4).values()) > capacity
    assert fewest_recomputed(profile, plain, 4, 1.0, stages) is None  # nothing fits at all
