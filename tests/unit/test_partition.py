from __future__ import annotations

import pytest
import torch

from lightning_pd2bw.engine.partition import balanced_partition, layer_parameter_counts, shared_parameters
from lightning_pd2bw.models import GPT, GPTConfig


def brute_force_best(costs, stages):
    import itertools

    best = None
    for cuts in itertools.combinations(range(1, len(costs)), stages - 1):
        bounds = (0, *cuts, len(costs))
        worst = max(sum(costs[bounds[i] : bounds[i + 1]]) for i in range(stages))
        best = worst if best is None else min(best, worst)
    return best


@pytest.mark.parametrize(
    "costs,stages",
    [([1] * 8, 4), ([5, 1, 1, 1, 1, 5], 3), ([9, 1, 1, 1, 1, 1, 1, 9], 2), ([3, 1, 4, 1, 5, 9, 2, 6], 4)],
)
def test_balanced_partition_is_optimal_and_contiguous(costs, stages):
    ranges = balanced_partition(costs, stages)
    assert [i for r in ranges for i in r] == list(range(len(costs)))
    assert all(len(r) > 0 for r in ranges)
    assert max(sum(costs[i] for i in r) for r in ranges) == brute_force_best(costs, stages)


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match="num_stages=5 exceeds the model's 3 pipeline layers"):
        balanced_partition([1, 1, 1], 5)


def test_gpt_tied_embedding_detected_by_identity():
    model = GPT(GPTConfig.from_name("tiny"))
    model.configure_model()
    layers = list(model.pipeline_layers())
    ranges = balanced_partition(layer_parameter_counts(layers), 2)
    shared = shared_parameters(layers, ranges)
    assert len(shared) == 1
    assert shared[0].stages == (0, 1)
    assert shared[0].locations == ((0, "wte.weight"), (len(layers) - 1, "weight"))


def test_gpt13b_on_meta_has_about_12_85b_parameters():
    config = GPTConfig.from_name("gpt13b")
    with torch.device("meta"):
        model = GPT(config)
        model.configure_model()
    count = sum(p.numel() for p in model.parameters())
    assert count == config.num_parameters()
    assert 12.8e9 < count < 12.9e9
    assert all(p.is_meta for p in model.parameters())


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match="valid names: gpt1.3b, gpt13b, gpt2, gpt2.2b, gpt3.8b, small, tiny"):
        GPTConfig.from_name("gpt5")
