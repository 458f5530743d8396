"""Mixed-precision weights (``PipelineOptions(weight_dtype=...)``, on by default under ``bf16-mixed``): the bytes of
weights and weight gradients moved per parameter per microbatch, outside the layers' own math.

Counted with a ``TorchDispatchMode`` around real training steps of a one-stage engine under CPU bfloat16 autocast
(cache off, as Lightning's plugin runs it): every aten op that is not a view and not the layers' math (matmuls, the
norm, the bias gradients' sums) adds the bytes of each parameter-shaped tensor it reads or writes. Those are the
casts of the weights, the conversions of their gradients and the accumulation into ``.grad``. Per microbatch is
the difference between a batch of 4 microbatches and one of 2, halved, so what happens once per step (the
optimizer, the new version's cast) cancels.

The bound follows from the bytes, not from a measurement: with bfloat16 versions over a float32 master, the one
thing left per microbatch is autograd adding each bfloat16 weight gradient into the float32 ``.grad`` (read 4 + 2,
write 4 bytes: 10). Casting the float32 weights at every forward (``weight_dtype=None``) costs a cast per forward
(read 4, write 2), another per recomputation, the gradient's conversion back (read 2, write 4) and a float32
accumulation (read 4 + 4, write 4): 30 with recomputation, 24 without, for the weights autocast casts (the
matmuls'; CPU autocast leaves layer_norm's alone).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_pd2bw import PipelineEngine
from lightning_pd2bw.engine import PipelineOptions
from lightning_pd2bw.planner import Candidate, LayerProfile
from lightning_pd2bw.planner.cost import ModelProfile, stage_memory

from ..distributed.launch import free_port

aten = torch.ops.aten
MATH = {  # the layers' own computation, which reads weights and writes weight gradients by necessity
    aten.mm,
    aten.addmm,
    aten.bmm,
    aten.native_layer_norm,
    aten.native_layer_norm_backward,
    aten.sum,
}
IN, HIDDEN, TOKENS = 24, 40, 3  # no activation (micro, TOKENS, IN or HIDDEN) has a parameter's shape


class WeightTraffic(TorchDispatchMode):
    """Bytes of parameter-shaped tensors read or written by ops other than views and ``MATH``."""

    def __init__(self, shapes: set[torch.Size]) -> None:
        super().__init__()
        self.shapes, self.bytes, self.ops = shapes, 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in MATH:
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        in_place = func.overloadpacket.__name__.endswith("_")
        if not in_place and any(_aliases(o, i) for o in outputs for i in inputs):
            return out  # a view: no bytes move
        moved = sum(t.numel() * t.element_size() for t in (*inputs, *outputs) if t.shape in self.shapes)
        if moved:
            self.bytes += moved
            self.ops[str(func)] = self.ops.get(str(func), 0) + moved
        return out


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.fixture
def one_process():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _layers() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Linear(IN, HIDDEN), nn.LayerNorm(HIDDEN), nn.Linear(HIDDEN, IN)]


def _batch_bytes(microbatches: int, mode: str, recompute: bool, weight_dtype) -> tuple[int, int, dict]:
    """Bytes counted in one steady-state batch of ``microbatches``, and the stage's parameter count."""
    layers = _layers()
    options = PipelineOptions(mode=mode, num_microbatches=microbatches, recompute=recompute, weight_dtype=weight_dtype)
    engine = PipelineEngine(layers, options, lambda batch: batch, lambda out, batch: out.float().pow(2).mean())
    engine.start(torch.optim.AdamW(engine.parameters(), lr=1e-3))
    params = engine.parameters()
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)  # noqa: E731
    batch = lambda: torch.randn(2 * microbatches, TOKENS, IN)  # noqa: E731
    for _ in range(3):  # past 2BW's first updates: the steady state
        engine.train_batch(batch(), context=autocast())
    traffic = WeightTraffic({p.shape for p in params})
    with traffic:
        engine.train_batch(batch(), context=autocast())
    engine.drain()
    engine.close()
    return traffic.bytes, sum(p.numel() for p in params), traffic.ops


def bytes_per_parameter_per_microbatch(mode: str, recompute: bool, weight_dtype) -> float:
    small, params, _ = _batch_bytes(2, mode, recompute, weight_dtype)
    large, _, _ = _batch_bytes(4, mode, recompute, weight_dtype)
    return (large - small) / 2 / params


@pytest.mark.parametrize("mode", ["2bw", "flush"])
@pytest.mark.parametrize("recompute", [True, False])
def test_bfloat16_versions_move_ten_bytes_per_parameter_per_microbatch(one_process, mode, recompute):
    mixed = bytes_per_parameter_per_microbatch(mode, recompute, torch.bfloat16)
    casts = bytes_per_parameter_per_microbatch(mode, recompute, None)
    assert mixed == pytest.approx(10.0, abs=0.01), f"bfloat16 versions: {mixed:.2f} bytes per parameter per microbatch"
    linear = 2 * IN * HIDDEN + IN + HIDDEN  # cast at every forward (and recomputation), converted back, accumulated
    norm = 2 * HIDDEN  # CPU autocast leaves layer_norm's float32 weights alone: accumulated only (read 4 + 4, write 4)
    expected = (linear * (30 if recompute else 24) + norm * 12) / (linear + norm)
    assert casts == pytest.approx(expected, abs=0.01), f"casts: {casts:.2f} bytes per parameter per microbatch"


def test_the_master_stays_float32_and_the_versions_bfloat16(one_process):
    """At rest the parameters are the float32 master (what checkpoints and callbacks see); each forward runs on a
    bfloat16 version; the optimizer's state is float32."""
    layers = _layers()
    options = PipelineOptions(mode="2bw", num_microbatches=2, weight_dtype="bfloat16", sync_steps=0)  # 2BW at once
    seen: list[torch.dtype] = []
    layers[0].register_forward_pre_hook(lambda module, args: seen.append(module.weight.dtype))
    engine = PipelineEngine(layers, options, lambda b: b, lambda out, b: out.float().pow(2).mean())
    engine.start(torch.optim.AdamW(engine.parameters(), lr=1e-3))
    for _ in range(3):
        engine.train_batch(torch.randn(4, TOKENS, IN), context=torch.autocast("cpu", dtype=torch.bfloat16))
        assert all(p.dtype == torch.float32 for p in engine.parameters())
    counters = engine.counters()  # in the steady state: two versions held
    engine.drain()
    assert set(seen) == {torch.bfloat16}
    state = [v for s in engine.optimizers[0].state.values() for v in s.values() if v.dim() > 0]
    assert state and all(v.dtype == torch.float32 for v in state)
    weights = sum(p.numel() for p in engine.parameters())
    assert counters["versions_bytes"] == weights * (4 + 2 * counters["weight_versions"])
    # the planner's weights term is what the engine holds: two bfloat16 versions and the float32 master
    profile = ModelProfile([LayerProfile(1.0, 2.0, 0.0, 0.0, weights)], weight_bytes=4, version_bytes=2)
    planned = stage_memory(profile, range(1), 0, Candidate.of(PipelineOptions(mode="2bw"), 1, 1, 1, False), 2)
    assert counters["weight_versions"] == 2 and planned["weights"] == counters["versions_bytes"]
    engine.close()


@pytest.mark.parametrize("mode", ["flush", "2bw"])
def test_flush_holds_one_set_of_float32_gradients_and_2bw_two(one_process, mode):
    """Mixed weights keep float32 gradients in buckets at every width. Flush finishes its update before the next
    batch computes, so one set serves every batch; 2BW's next batch accumulates while the last one's update waits,
    so it holds two. Each equals the planner's gradients term (flush held two sets before: 4 bytes per parameter
    more than planned, 1.5 GiB on the 1.3B-shaped slice of an H200 run)."""
    layers = _layers()
    engine = PipelineEngine(
        layers,
        PipelineOptions(mode=mode, num_microbatches=2, weight_dtype="bfloat16"),
        lambda b: b,
        lambda out, b: out.float().pow(2).mean(),
    )
    engine.start(torch.optim.AdamW(engine.parameters(), lr=1e-3))
    for _ in range(3):
        engine.train_batch(torch.randn(4, TOKENS, IN), context=torch.autocast("cpu", dtype=torch.bfloat16))
    counters = engine.counters()
    weights = sum(p.numel() for p in engine.parameters())
    profile = ModelProfile([LayerProfile(1.0, 2.0, 0.0, 0.0, weights)], weight_bytes=4, version_bytes=2)
    planned = stage_memory(profile, range(1), 0, Candidate.of(PipelineOptions(mode=mode), 1, 1, 1, False), 2)
    assert planned["gradients"] == 4 * weights * (2 if mode == "2bw" else 1)
    held = counters["gradient_buffer_bytes"]  # each bucket's start aligned: a few bytes over the parameters'
    assert planned["gradients"] <= held < planned["gradients"] * 1.01
    engine.drain()
    engine.close()


def test_a_parameter_not_in_float32_is_refused_by_name(one_process):
    layers = [nn.Linear(4, 4), nn.Linear(4, 4).to(torch.float64)]
    engine = PipelineEngine(layers, PipelineOptions(weight_dtype="bfloat16"), lambda b: b, lambda o, b: o.sum())
    with pytest.raises(ValueError, match=r"parameter 2 is torch.float64.*weight_dtype=None"):
        engine.start(torch.optim.SGD(engine.parameters(), lr=0.1))
    engine.close()


def test_a_layer_that_mixes_float32_inputs_with_bfloat16_weights_says_what_to_set(one_process):
    """A float32 input into a norm with bfloat16 weights fails on the CPU; the error says why and names the option as
    its caller writes it (here the engine's: ``PipelineOptions(...)``)."""
    engine = PipelineEngine(
        [nn.LayerNorm(IN)],
        PipelineOptions(weight_dtype="bfloat16", num_microbatches=1),
        lambda b: b,
        lambda o, b: o.sum(),
    )
    engine.start(torch.optim.SGD(engine.parameters(), lr=0.1))
    with pytest.raises(RuntimeError) as raised:
        engine.train_batch(torch.randn(2, TOKENS, IN), context=torch.autocast("cpu", dtype=torch.bfloat16))
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "PipelineOptions(weight_dtype=None)" in notes
    engine.close()


def _trained_weights(mode: str, recompute: bool, compile: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    layers = [nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, IN)]
    options = PipelineOptions(
        mode=mode, num_microbatches=2, weight_dtype="bfloat16", recompute=recompute, compile=compile
    )
    engine = PipelineEngine(layers, options, lambda b: b, lambda out, b: out.float().pow(2).mean())
    engine.start(torch.optim.AdamW(engine.parameters(), lr=1e-2))
    data = torch.Generator().manual_seed(1)
    for _ in range(4):
        batch = torch.randn(4, TOKENS, IN, generator=data)
        engine.train_batch(batch, context=torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False))
    engine.drain()
    weights = [p.detach().clone() for p in engine.parameters()]
    engine.close()
    return weights


@pytest.mark.parametrize("mode", ["2bw", pytest.param("flush", marks=pytest.mark.full)])  # compiles: ~17 s each
@pytest.mark.parametrize("recompute", [False, pytest.param(True, marks=pytest.mark.full)])
def test_compiled_layers_train_on_bfloat16_versions_with_float32_gradients(one_process, mode, recompute):
    """Dynamo cannot trace a bfloat16 parameter holding a float32 ``.grad`` (torch's fake-tensor converter raises
    "attempting to assign a gradient with dtype 'float'"; first seen on an H200 with torch 2.11, and torch 2.13's
    CPU build does the same). The compiled layers run with those gradients detached, and train as the eager ones:
    the same kernels on the CPU, so bitwise."""
    compiled = _trained_weights(mode, recompute, compile=True)
    eager = _trained_weights(mode, recompute, compile=False)
    assert all(torch.equal(c, e) for c, e in zip(compiled, eager))
