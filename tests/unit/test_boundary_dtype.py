"""Under bf16-mixed, activations and their gradients cross stage boundaries in bfloat16 (half the bytes on the
wire and in the next stage's stash); the stage's own outputs and its weight gradients stay in float32."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from torch import nn

from lightning_pd2bw import PipeDream2BWStrategy
from lightning_pd2bw.engine.comm.transport import LinkChannels, StageLink
from lightning_pd2bw.engine.executor import StageExecutor
from lightning_pd2bw.engine.layout import Layout
from lightning_pd2bw.engine.options import PipelineOptions
from lightning_pd2bw.engine.schedules import schedule as S
from lightning_pd2bw.engine.state.versions import WeightVersions


def first_stage(boundary_dtype):
    torch.manual_seed(0)
    layer = nn.Linear(8, 8)
    link = StageLink(None, 1, torch.device("cpu"), LinkChannels(next="with stage 1"))
    executor = StageExecutor(
        [layer], 0, Layout(2, 2, "flush"), link, WeightVersions(layer.parameters(), double_buffer=False),
        input_fn=lambda mb: mb["x"], loss_fn=None, options=PipelineOptions(boundary_dtype=boundary_dtype),
    )  # fmt: skip
    executor.feed(0, [{"x": torch.randn(4, 8)}, {"x": torch.randn(4, 8)}])
    return layer, executor


def test_activations_leave_in_bf16_and_gradients_return_into_float32():
    layer, executor = first_stage(torch.bfloat16)
    x = executor._microbatches[0]["x"]
    executor.run([S.Action(S.FORWARD, 0, 0, 0)])  # a float32 output (e.g. the residual)
    (sent,) = executor._to_send[(0, 0)]
    assert sent.dtype == torch.bfloat16 and not sent.requires_grad
    torch.testing.assert_close(sent, layer(x).detach().to(torch.bfloat16), rtol=0, atol=0)
    assert executor._stash[(0, 0)][1].dtype == torch.float32, "the stage's own graph stays in float32"
    grad = torch.randn(4, 8).to(torch.bfloat16)  # what the next stage sends back
    executor._to_send.clear()
    executor._grads_in[(0, 0)] = [grad]
    executor.run([S.Action(S.BACKWARD, 0, 0, 0)])
    assert layer.weight.grad.dtype == torch.float32
    torch.testing.assert_close(layer.weight.grad, grad.float().t() @ x)


def test_no_boundary_dtype_sends_the_tensor_as_computed():
    _, executor = first_stage(None)
    executor.run([S.Action(S.FORWARD, 0, 0, 0)])
    assert executor._to_send[(0, 0)][0].dtype == torch.float32


@pytest.mark.parametrize(
    "plugin,option,expected",
    [
        (MixedPrecision("bf16-mixed", "cpu"), "auto", torch.bfloat16),
        (Precision(), "auto", None),
        (MixedPrecision("bf16-mixed", "cpu"), None, None),
        (Precision(), torch.bfloat16, torch.bfloat16),
        (Precision(), "float16", torch.float16),
    ],
)
@pytest.mark.parametrize("name", ["boundary_dtype", "weight_dtype"])
def test_auto_is_bf16_under_bf16_mixed_only(plugin, option, expected, name):
    """The one rule (``PipelineOptions.resolve``) the strategy resolves its dtypes by, from its precision plugin."""
    options = PipeDream2BWStrategy(num_stages=1, precision_plugin=plugin, **{name: option}).options
    run = options.resolve(1, str(plugin.precision))
    assert getattr(run, name) == getattr(run.options, name) == expected


@pytest.mark.parametrize("name", ["boundary_dtype", "weight_dtype"])
def test_bad_dtype_option_is_named(name):
    for bad in ("bf16", torch.int64):
        with pytest.raises(ValueError, match=f"{name}=.*torch.bfloat16 or 'bfloat16'"):
            PipeDream2BWStrategy(**{name: bad})
