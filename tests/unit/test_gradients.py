"""The update's gradient collectives on one process (a gloo group of one rank): what they compute and hold."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_pd2bw.pipeline import gradients


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
    gradients.average_over_replicas(params, group, size=2)  # one rank: the sum is the gradient itself
    assert len(live) == 6
    assert most == 2, "the next bucket's all-reduce overlaps the previous one's copy-back; no more is held"
    for i, param in enumerate(params):
        assert torch.equal(param.grad, torch.full((1000,), (i + 1) / 2))


def test_clip_by_norm_equals_torch(group):
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(s)) for s in [(5, 3), (7,), (2, 2, 2)]]
    twins = [nn.Parameter(p.detach().clone()) for p in params]
    for p, t in zip(params, twins):
        p.grad = torch.randn_like(p) * 10
        t.grad = p.grad.clone()
    gradients.clip_by_norm(params, 1.0, set(), group, torch.device("cpu"))
    torch.nn.utils.clip_grad_norm_(twins, 1.0)
    for p, t in zip(params, twins):
        torch.testing.assert_close(p.grad, t.grad, rtol=1e-6, atol=1e-7)
    total = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params]))
    assert abs(total.item() - 1.0) < 1e-5
