"""The update's gradient collectives on one process (a gloo group of one rank): what they compute and hold."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_pd2bw.engine.updates import gradients
from lightning_pd2bw.engine.updates.update_parts import TiedSums


@pytest.fixture
def group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_replica_average_flattens_at_most_two_buckets_at_once(group, monkeypatch):
    params = [nn.Parameter(torch.zeros(1000)) for _ in range(6)]
    for i, param in enumerate(params):
        param.grad = torch.full((1000,), float(i + 1))
    monkeypatch.setattr(gradients, "BUCKET_BYTES", 4000)  # one gradient per bucket: six buckets
    flatten = torch._utils._flatten_dense_tensors
    live: list[weakref.ref] = []
    most = 0

    def counting(tensors):
        nonlocal most
        gc.collect()
        buffer = flatten(tensors)
        live.append(weakref.ref(buffer))
        most = max(most, sum(ref() is not None for ref in live))
        return buffer

    monkeypatch.setattr(torch._utils, "_flatten_dense_tensors", counting)
    monkeypatch.setattr(gradients, "buckets", lambda grads, limit=None: [[g] for g in grads])
    gradients.average_over_replicas(
        [p.grad for p in params], group, 2, TiedSums.AVERAGE
    )  # one rank: the sum is the gradient itself
    assert len(live) == 6
    assert most == 2, "the next bucket's all-reduce overlaps the previous one's copy-back; no more is held"
    for i, param in enumerate(params):
        assert torch.equal(param.grad, torch.full((1000,), (i + 1) / 2))


def test_clip_by_the_norm_summed_over_a_group_equals_torch(group):
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(s)) for s in [(5, 3), (7,), (2, 2, 2)]]
    twins = [nn.Parameter(p.detach().clone()) for p in params]
    for p, t in zip(params, twins):
        p.grad = torch.randn_like(p) * 10
        t.grad = p.grad.clone()
    squares = gradients.squared_norm([p.grad for p in params], torch.device("cpu"))
    torch.distributed.all_reduce(squares, group=group)  # one rank: what the pipeline's sum would give
    gradients.scale_to_norm([p.grad for p in params], squares, 1.0)
    torch.nn.utils.clip_grad_norm_(twins, 1.0)
    for p, t in zip(params, twins):
        torch.testing.assert_close(p.grad, t.grad, rtol=1e-6, atol=1e-7)
    total = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params]))
    assert abs(total.item() - 1.0) < 1e-5


def test_finite_watch_names_the_first_nonfinite_update_and_its_parameters():
    a, b = nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))
    watch = gradients.FiniteWatch()
    a.grad, b.grad = torch.ones(3), torch.ones(2)
    watch.push(7, [a, b])
    assert watch.poll() is None and not watch.pending
    a.grad, b.grad = torch.ones(3), torch.tensor([1.0, float("nan")])
    watch.push(8, [a, b])
    a.grad = torch.tensor([float("inf"), 0.0, 0.0])
    watch.push(9, [a, b])
    step, bad = watch.poll(wait=True)
    assert step == 8 and bad == [b]
    step, bad = watch.poll(wait=True)
    assert step == 9 and bad == [a, b]
    assert watch.poll(wait=True) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_finite_flags_match_isfinite_on_every_kind_of_bad_entry(dtype):
    torch.manual_seed(0)
    grads = [torch.randn(5, 7).to(dtype) * 100 for _ in range(12)]
    grads[1][2, 3] = float("nan")
    grads[4][0, 0] = float("inf")
    grads[6][4, 6] = -float("inf")
    grads[8][1, 1], grads[8][2, 2] = float("inf"), -float("inf")
    grads[9].fill_(float("inf"))  # min == max == inf
    grads[10].fill_(torch.finfo(dtype).max)  # finite extremes stay finite
    grads[11][3] = -torch.finfo(dtype).max
    expected = [bool(torch.isfinite(g).all()) for g in grads]
    assert gradients.finite_flags(grads).tolist() == expected
    assert expected == [True, False, True, True, False, True, False, True, False, False, True, True]


def test_finite_flags_of_sparse_empty_and_mixed_dtype_gradients():
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.0, float("nan")], (4,))
    duplicate = torch.sparse_coo_tensor([[1, 1]], [3e38, 3e38], (4,))  # the dense gradient holds their sum: inf
    complex_bad = torch.tensor([1 + 1j, complex(0, float("nan"))])
    grads = [torch.ones(3), sparse, duplicate, torch.zeros(0), torch.ones(2, dtype=torch.bfloat16), complex_bad]
    assert gradients.finite_flags(grads).tolist() == [True, False, False, True, True, False]
    assert gradients.finite_flags([torch.tensor([1 + 2j])]).tolist() == [True]
    embedding = nn.Embedding(4, 2, sparse=True)  # the stop policy's check of a sparse gradient (isfinite has none)
    embedding(torch.tensor([1, 3])).sum().backward()
    watch = gradients.FiniteWatch()
    watch.push(0, [embedding.weight])
    assert embedding.weight.grad.is_sparse and watch.poll(wait=True) is None
    embedding.weight.grad = torch.sparse_coo_tensor([[2]], [[float("inf"), 0.0]], (4, 2))
    watch.push(1, [embedding.weight])
    assert watch.poll(wait=True) == (1, [embedding.weight])


def test_nonfinite_flag_stays_on_the_device():
    p = nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([0.0, float("-inf")])
    flag = gradients.nonfinite_flag([p.grad], torch.device("cpu"))
    assert flag.shape == (1,) and flag.item() == 1.0
    p.grad = torch.zeros(2)
    assert gradients.nonfinite_flag([p.grad], torch.device("cpu")).item() == 0.0
    assert gradients.nonfinite_flag([], torch.device("cpu")).item() == 0.0
