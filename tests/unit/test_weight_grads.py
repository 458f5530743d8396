"""The split backward (``engine/weight_grads.py``): B leaves the linear maps' weight gradients to W, and B then W
gives the gradients of one undivided backward (float64: the same sums, in the same order per microbatch)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_pd2bw.engine.weight_grads import WeightGradients


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 12)
        self.norm = nn.LayerNorm(12)
        self.down = nn.Linear(12, 6, bias=False)
        self.embed = nn.Embedding(10, 6)

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        h = self.down(torch.relu(self.norm(self.up(x + self.embed(ids)))))
        h = self.up(h)[..., :6] + h  # one layer used twice in a microbatch
        return nn.functional.linear(h, self.embed.weight)  # a tied output projection


def grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def test_b_then_w_gives_the_undivided_backward():
    torch.manual_seed(0)
    model = Tiny().double()
    batches = [(torch.randn(3, 5, 6, dtype=torch.float64), torch.randint(0, 10, (3, 5))) for _ in range(3)]
    for x, ids in batches:
        model(x, ids).square().mean().backward()
    expected = grads(model)
    model.zero_grad(set_to_none=True)

    split = WeightGradients()
    inputs = []
    for k, (x, ids) in enumerate(batches):
        x = x.clone().requires_grad_()
        with split.intercept(k):
            loss = model(x, ids).square().mean()
        loss.backward()  # B
        split.after_backward(k)
        inputs.append(x)
        if k == 0:  # after B alone: the linear maps' weights wait for W, the rest is in
            assert model.up.weight.grad is None and model.up.bias.grad is None and model.down.weight.grad is None
            assert model.norm.weight.grad is not None and inputs[0].grad is not None
    assert split.pending_bytes > 0 and split.peak_bytes == split.pending_bytes
    for k in range(len(batches)):
        split.compute(k)  # W
    assert split.pending_bytes == 0 and not split.in_flight
    got = grads(model)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-12, atol=1e-14, msg=name)


def test_under_autocast_the_split_computes_in_autocasts_dtype():
    torch.manual_seed(0)
    model = Tiny()
    x, ids = torch.randn(4, 6), torch.randint(0, 10, (4,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x, ids).float().square().mean().backward()
    expected = grads(model)
    model.zero_grad(set_to_none=True)
    split = WeightGradients()
    with split.intercept(0), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, ids)
    assert out.dtype == torch.bfloat16
    out.float().square().mean().backward()
    split.compute(0)
    for name, value in grads(model).items():
        assert value.dtype == torch.float32
        # the same bf16 products; sums in another order: within bf16's rounding of the gradients' scale
        scale = expected[name].abs().max().item()
        torch.testing.assert_close(value, expected[name], rtol=0, atol=2e-2 * scale + 1e-6, msg=name)


def test_what_runs_without_grad_is_not_deferred():
    model = Tiny()
    split = WeightGradients()
    with split.intercept(0), torch.no_grad():
        model(torch.randn(2, 6), torch.randint(0, 10, (2,)))
    split.compute(0)
    assert all(p.grad is None for p in model.parameters())


def test_nothing_is_kept_after_w():
    """The kept inputs are freed once W has run: a kept input's grad_fn leads back to the nodes that kept it, a cycle
    through autograd's C++ nodes Python's collector cannot free (before the fix every step leaked its activations)."""
    import gc
    import weakref

    first, second = nn.Linear(4, 8), nn.Linear(8, 2)
    split = WeightGradients()
    x = torch.randn(3, 4, requires_grad=True)
    with split.intercept(0):
        hidden = torch.relu(first(x))  # the second linear's input, kept for its W
        out = second(hidden)
    kept = weakref.ref(hidden)
    out.sum().backward()
    split.compute(0)
    del hidden, out
    gc.collect()
    assert kept() is None
