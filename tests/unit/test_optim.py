"""models/optim.py: the optimizers and schedule the models' configuration chooses, usable without Lightning."""

from __future__ import annotations

import pytest
import torch

from lightning_pd2bw.models import GPT, GPTConfig, GPTCore
from lightning_pd2bw.models.optim import block_matrices, build_optimizers, warmup_cosine_schedule


@pytest.mark.parametrize("name", ["adamw", "nadamw", "sgd", "muon"])
def test_every_parameter_is_in_one_optimizer_as_the_module_configures_it(name):
    core = GPTCore(GPTConfig.from_name("tiny", n_layer=2))
    params = list(core.parameters())
    optimizers = build_optimizers(params, block_matrices(list(core.layers)[1:-1]), name, lr=1e-3)
    held = [id(p) for o in optimizers for g in o.param_groups for p in g["params"]]
    assert sorted(held) == sorted(id(p) for p in params) and len(held) == len(set(held))
    module = GPT(GPTConfig.from_name("tiny", n_layer=2), optimizer=name, lr=1e-3)
    module.configure_model()
    configured = module.configure_optimizers()
    configured = configured if isinstance(configured, list) else [configured]
    assert [type(o) for o in configured] == [type(o) for o in optimizers]
    if name == "muon":  # Muon takes exactly the blocks' matrices; AdamW the rest, 1-D tensors without decay
        assert [p.dim() for p in optimizers[0].param_groups[0]["params"]] == [2] * 8
        assert all(p.dim() < 2 for p in optimizers[1].param_groups[1]["params"])


def test_schedule_warms_up_then_decays_to_its_floor():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    schedule = warmup_cosine_schedule(optimizer, warmup_steps=2, max_steps=10, min_lr_ratio=0.1)
    lrs = []
    for _ in range(12):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert lrs[:3] == pytest.approx([0.5, 1.0, 1.0]) and lrs[10] == pytest.approx(0.1) and lrs[11] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))


def test_unknown_optimizer_names_the_valid_ones():
    with pytest.raises(ValueError, match="optimizer='lion' is not supported; valid: adamw, nadamw, sgd, muon"):
        build_optimizers([torch.nn.Parameter(torch.zeros(2, 2))], [], "lion")


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_models_step_with_foreach_kernels_on_the_cpu_as_the_per_tensor_loop_does(name):
    """The models' optimizers use torch's multi-tensor kernels (``foreach`` on the CPU; ``fused`` on CUDA, checked
    in tests/gpu): the same update as the per-tensor loop, masked weights staying zero under a step post-hook."""
    torch.manual_seed(0)
    core = GPTCore(GPTConfig.from_name("tiny", n_layer=2))
    params = [p for p in core.parameters()]
    [fast] = build_optimizers(params, [], name, lr=1e-2, momentum=0.9)
    assert all(group["foreach"] for group in fast.param_groups) and not fast.defaults.get("fused")
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    [loop] = build_optimizers(twins, [], name, lr=1e-2, momentum=0.9)
    for group in loop.param_groups:
        group["foreach"] = False
    masked = next(i for i, p in enumerate(params) if p.dim() == 2)
    mask = torch.rand_like(params[masked]) > 0.5
    for optimizer, tensors in ((fast, params), (loop, twins)):
        optimizer.register_step_post_hook(lambda *_, t=tensors: t[masked].data.mul_(mask))
    for step in range(4):
        for tensors, optimizer in ((params, fast), (twins, loop)):
            for index, param in enumerate(tensors):
                param.grad = torch.sin(torch.arange(param.numel(), dtype=torch.float32) + step + index).view_as(param)
            optimizer.step()
    for a, b in zip(params, twins):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert (params[masked][~mask] == 0).all() and params[masked][mask].abs().min() > 0


def test_placeholders_of_other_stages_are_left_out_of_the_models_optimizers():
    """Under strategy="pd2bw" other stages' parameters are meta placeholders: the optimizers hold the real ones
    (so that fused CUDA kernels, which refuse meta tensors, can be used); all-meta parameters are kept as given."""
    real = [torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))]
    meta = [torch.nn.Parameter(torch.zeros(2, 2, device="meta"))]
    [optimizer] = build_optimizers(real + meta, [], "adamw")
    assert [p for g in optimizer.param_groups for p in g["params"]] == real
    [on_meta] = build_optimizers(meta, [], "adamw")
    assert [p for g in on_meta.param_groups for p in g["params"]] == meta


def _muon_run(make, steps: int = 3) -> list[torch.Tensor]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(24, 16)), torch.nn.Parameter(torch.randn(8, 40))]
    optimizer = make(params)
    for step in range(steps):
        for index, param in enumerate(params):
            param.grad = torch.cos(torch.arange(param.numel(), dtype=torch.float32) * (step + index + 1)).view_as(param)
        optimizer.step()
    return [p.detach().clone() for p in params]


def test_muon_with_bfloat16_newton_schulz_steps_exactly_as_torchs():
    from lightning_pd2bw.models.optim import Muon

    options = dict(lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    ours = _muon_run(lambda p: Muon(p, ns_dtype=torch.bfloat16, **options))
    torchs = _muon_run(lambda p: torch.optim.Muon(p, **options))
    for a, b in zip(ours, torchs):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for adjust in (None, "original"):
        ours = _muon_run(lambda p, f=adjust: Muon(p, lr=0.02, adjust_lr_fn=f, ns_dtype=torch.bfloat16))
        torchs = _muon_run(lambda p, f=adjust: torch.optim.Muon(p, lr=0.02, adjust_lr_fn=f))
        for a, b in zip(ours, torchs):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_muon_on_the_cpu_runs_newton_schulz_in_float32_within_bfloat16s_rounding():
    """On the CPU the iteration runs in float32 (bfloat16 matmuls have no fast CPU kernels: ~30x slower here). It
    differs from torch's bfloat16 iteration by no more than bfloat16 itself moves when its input is perturbed at
    bfloat16's resolution (measured: 1.1-1.5% against 1.0-2.1%, Frobenius, relative)."""
    from lightning_pd2bw.models.optim import Muon, newton_schulz

    coefficients = (3.4445, -4.7750, 2.0315)  # torch's defaults
    generator = torch.Generator().manual_seed(0)
    for shape in [(24, 16), (64, 256), (256, 96)]:
        grad = torch.randn(*shape, generator=generator)
        noisy = grad * (1 + 4e-3 * torch.randn(*shape, generator=generator))  # bfloat16's relative resolution

        def ns(g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            return newton_schulz(g, coefficients, 5, 1e-7, dtype).float()

        bf16 = ns(grad, torch.bfloat16)
        ours = (ns(grad, torch.float32) - bf16).norm() / bf16.norm()
        itself = (ns(noisy, torch.bfloat16) - bf16).norm() / bf16.norm()
        assert 0 < ours < 2 * itself, (shape, ours.item(), itself.item())
    options = dict(lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    default = _muon_run(lambda p: Muon(p, **options))
    for a, b in zip(default, _muon_run(lambda p: Muon(p, ns_dtype=torch.float32, **options))):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the CPU's default is float32
    matrix, bias = torch.nn.Parameter(torch.zeros(4, 4)), torch.nn.Parameter(torch.zeros(4))
    [muon, _] = build_optimizers([matrix, bias], [matrix], "muon")
    assert type(muon).__name__ == "Muon" and muon.ns_dtype is None


def test_supars_scaled_rate_keeps_adamws_weight_decay_of_the_dense_layer():
    """``scale_learning_rates`` at 4x (density 1/4): the scaled group steps at 4 x the rate and decays as the dense
    group does (μP's independent weight decay). By hand: with a zero gradient (Adam's update 0 / (0 + eps) = 0) both
    parameters shrink by exactly 1 - lr x wd; with a unit gradient, Adam's first update is 1 (eps aside), so the
    scaled one moves 4 x lr where the dense one moves lr, both after the same decay."""
    from lightning_pd2bw.models.optim import scale_learning_rates

    lr, wd = 1e-2, 0.1
    for gradient, moved in ((0.0, (0.0, 0.0)), (1.0, (lr, 4 * lr))):
        dense, sparse = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
        optimizer = torch.optim.AdamW([dense, sparse], lr=lr, weight_decay=wd)
        scale_learning_rates([optimizer], {id(sparse): 4.0})
        scaled = next(g for g in optimizer.param_groups if g["params"][0] is sparse)
        assert scaled["lr"] == 4 * lr and scaled["lr"] * scaled["weight_decay"] == pytest.approx(lr * wd)
        dense.grad, sparse.grad = torch.full((3,), gradient), torch.full((3,), gradient)
        optimizer.step()
        for param, step in zip((dense, sparse), moved):
            torch.testing.assert_close(param.detach(), torch.full((3,), 1 - lr * wd - step), rtol=0, atol=1e-6)


def test_nadamw_takes_dozats_nesterov_step_with_decoupled_decay():
    """Two steps of ``nadamw`` on a matrix against NAdam's update written out by hand (Dozat 2016 with torch's
    momentum schedule ``mu_t = beta1 (1 - 0.5 * 0.96 ** (0.004 t))``; weight decay decoupled: ``w *= 1 - lr wd``)."""
    lr, wd, (b1, b2), eps = 1e-2, 0.1, (0.9, 0.95), 1e-8
    weight = torch.nn.Parameter(torch.tensor([[1.0, -2.0], [0.5, 3.0]], dtype=torch.float64))
    (optimizer,) = build_optimizers([weight], [], "nadamw", lr=lr, weight_decay=wd, betas=(b1, b2))
    expected = weight.detach().clone()
    m = v = torch.zeros_like(expected)
    product = 1.0
    grads = [torch.tensor([[0.3, -0.1], [0.2, 0.4]], dtype=torch.float64), torch.tensor([[-0.5, 0.2], [0.1, 0.0]])]
    for t, grad in enumerate(grads, start=1):
        weight.grad = grad.to(torch.float64)
        optimizer.step()
        grad = grad.to(torch.float64)
        mu, mu_next = (b1 * (1 - 0.5 * 0.96 ** (0.004 * k)) for k in (t, t + 1))
        product *= mu
        expected = expected * (1 - lr * wd)
        m = b1 * m + (1 - b1) * grad
        v = b2 * v + (1 - b2) * grad * grad
        denominator = (v / (1 - b2**t)).sqrt() + eps
        expected = expected - lr * (1 - mu) / (1 - product) * grad / denominator
        expected = expected - lr * mu_next / (1 - product * mu_next) * m / denominator
        # torch keeps mu_product in float32: its relative error 6e-8 on an update of at most 2 lr (= 0.02) per step
        assert torch.allclose(weight.detach(), expected, rtol=0.0, atol=2 * 6e-8 * 2 * lr * t), t
