"""Stage boundaries of any order train every stage (DESIGN.md, the partition contract: integer/bool entries travel
without gradients, in any position). A ``(mask, hidden)`` boundary used to pair the returned gradients with the
wrong outputs and drop them: stage 0's weights never moved, silently, in both modes."""

from __future__ import annotations

import pytest
import torch

from .launch import torchrun_script
from .run_boundaries import LR, NUM_MICROBATCHES, batches, layers, loss_fn

SCRIPT = __import__("pathlib").Path(__file__).with_name("run_boundaries.py")


def run_layers(model: list[torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
    value = x
    for layer in model:
        value = layer(*value) if isinstance(value, tuple) else layer(value)
    return value


def reference(mode: str) -> list[dict[str, torch.Tensor]]:
    """One process: gradient accumulation over the microbatches; 2BW evaluates batch t's gradient at the weights of
    version max(t - 1, 0) and applies it to the newest (W(t+1) = W(t) - lr * grad f(W(t-1))); plain SGD."""
    model = layers()
    params = [p for layer in model for p in layer.parameters()]
    versions = [[p.detach().clone() for p in params]]
    for t, batch in enumerate(batches()):
        evaluated = versions[max(t - 1, 0)] if mode == "2bw" else versions[t]
        newest = versions[t]
        with torch.no_grad():
            for p, w in zip(params, evaluated):
                p.copy_(w)
        for p in params:
            p.grad = None
        size = len(batch["x"]) // NUM_MICROBATCHES
        for j in range(NUM_MICROBATCHES):
            part = {k: v[j * size : (j + 1) * size] for k, v in batch.items()}
            (loss_fn(run_layers(model, part["x"]), part) / NUM_MICROBATCHES).backward()
        versions.append([w - LR * p.grad for w, p in zip(newest, params)])
    with torch.no_grad():
        for p, w in zip(params, versions[-1]):
            p.copy_(w)
    return [layer.state_dict() for layer in model]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("boundaries")
    torchrun_script(SCRIPT, [str(out), "flush", "2bw"], world=3, timeout=300)
    return out


@pytest.mark.parametrize("mode", ["flush", "2bw"])
def test_every_stage_trains_exactly(trained, mode):
    expected = reference(mode)
    initial = [layer.state_dict() for layer in layers()]
    for stage in range(3):
        got = torch.load(trained / f"boundaries-{mode}-rank{stage}.pt", weights_only=True)
        want = {k.split(".", 1)[1]: v for k, v in got.items()}
        assert set(want) == set(expected[stage]), got.keys()
        for name, value in want.items():
            torch.testing.assert_close(value, expected[stage][name], rtol=1e-5, atol=1e-6)
            assert not torch.equal(value, initial[stage][name]), f"stage {stage} {name} never moved"
