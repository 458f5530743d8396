"""2BW's weight swaps inside one caching autocast region (plain ``torch.autocast``, as a user of the engine
without Lightning writes it): every forward and recomputation runs on its own version's bf16 cast."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_pd2bw.engine.comm.transport import StageLink
from lightning_pd2bw.engine.executor import StageExecutor
from lightning_pd2bw.engine.layout import Layout
from lightning_pd2bw.engine.options import PipelineOptions
from lightning_pd2bw.engine.schedules import schedule
from lightning_pd2bw.engine.state.versions import WeightVersions
from tests.stage_update import local_update

LR, STEPS, M = 0.5, 4, 2


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def batches() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(4, 8, generator=g), "y": torch.randn(4, 1, generator=g)} for _ in range(STEPS)]


def loss_fn(out, mb):
    return nn.functional.mse_loss(out.float(), mb["y"])


def pipeline_weights(recompute: bool) -> list[torch.Tensor]:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)

    def step(batch: int) -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    versions = WeightVersions(model.parameters(), double_buffer=True)
    executor = StageExecutor(
        list(model), 0, Layout(1, M, "2bw"), StageLink(None, None, torch.device("cpu")), versions,
        input_fn=lambda mb: mb["x"], loss_fn=loss_fn, handlers=local_update(versions, step),
        options=PipelineOptions(recompute=recompute, boundary_dtype=None),
    )  # fmt: skip
    with torch.autocast("cpu", dtype=torch.bfloat16):  # one region, cast cache on (the default)
        for t, batch in enumerate(batches()):
            executor.feed(t, [{k: v.chunk(M)[j] for k, v in batch.items()} for j in range(M)])
            executor.run(schedule.segment(Layout(1, M, "2bw"), 0, t))
        executor.run(schedule.drain(Layout(1, M, "2bw"), 0, STEPS - 1))
    executor.finish_drain()
    return [p.detach().clone() for p in model.parameters()]


def reference_weights() -> list[torch.Tensor]:
    """W(t+1) = W(t) - lr * grad f(W(t-1)), each microbatch in its own autocast region."""
    model = make_model()
    history = [[p.detach().clone() for p in model.parameters()]]
    for t, batch in enumerate(batches()):
        stale = history[max(t - 1, 0)]
        grads = [torch.zeros_like(p) for p in stale]
        for j in range(M):
            weights = [w.clone().requires_grad_() for w in stale]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                x = torch.tanh(nn.functional.linear(batch["x"].chunk(M)[j], weights[0], weights[1]))
                out = nn.functional.linear(x, weights[2], weights[3])
                loss = loss_fn(out, {"y": batch["y"].chunk(M)[j]}) / M
            for g, d in zip(grads, torch.autograd.grad(loss, weights)):
                g += d
        history.append([w - LR * g for w, g in zip(history[-1], grads)])
    return history[-1]


@pytest.mark.parametrize("recompute", [False, True])
def test_version_swaps_never_use_a_stale_cast(recompute):
    expected = reference_weights()
    got = pipeline_weights(recompute)
    initial = [p.detach() for p in make_model().parameters()]
    assert max((e - i).abs().max().item() for e, i in zip(expected, initial)) > 0.05, "the versions differ a lot"
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-3, atol=1e-4)
