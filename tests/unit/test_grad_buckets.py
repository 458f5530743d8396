"""Replica gradients in buckets (``grad_buckets.py``) on two gloo ranks: started inside the last backward, equal to
the average of each replica's plain autograd gradients, ``None`` where no replica had a gradient."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_pd2bw.engine.updates import grad_buckets
from lightning_pd2bw.engine.updates.grad_buckets import GradientBuckets

MICROBATCHES = 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Parameter(torch.ones(4))  # no replica uses it: its gradient stays None
        self.rank0_only = nn.Parameter(torch.ones(6))  # used on rank 0 alone: averaged with rank 1's zeros
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))  # their buckets come first

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if rank == 0:
            x = x * self.rank0_only
        return x.pow(2).mean()


def finish(buckets: GradientBuckets) -> None:
    """What flush's update does with the buckets (``BucketReducer``): hand them over, wait, and read each parameter's
    averaged gradient back into ``.grad`` (None where no replica had one)."""
    averaged = buckets.complete(buckets.launch(double_buffered=False))
    for bucket in buckets.buckets:
        for param in bucket.params:
            param.grad = averaged[id(param)]


def _rank(rank: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)
    net, twin = Net(), Net()
    twin.load_state_dict(net.state_dict())
    starts: list[bool] = []  # per bucket all-reduce: whether the first layer's gradient was in already
    first_layer_in = [False]
    all_reduce = dist.all_reduce

    def recording(tensor, *args, **kwargs):
        starts.append(first_layer_in[0])
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = recording  # the module the buckets issue through (engine/updates/collectives.py)
    buckets = GradientBuckets(list(net.parameters()), dist.group.WORLD, size=2, limit=6 * 6 * 4)
    assert all(p.grad is not None for p in net.parameters()), "every .grad is a bucket view from the start"
    net.layers[0].weight.register_post_accumulate_grad_hook(lambda _: first_layer_in.__setitem__(0, True))
    for step in range(2):  # the second step checks that zero() leaves nothing behind
        starts.clear()
        torch.manual_seed(100 * step + rank)
        data = [torch.randn(5, 6) for _ in range(MICROBATCHES)]
        for j, x in enumerate(data):
            if j == MICROBATCHES - 1:
                buckets.arm()
                first_layer_in[0] = False
            (net(x, rank) / MICROBATCHES).backward()
        assert starts and not starts[0], "the first bucket started before the backward reached the first layer"
        finish(buckets)
        assert len(starts) == buckets.num_buckets > 2, "every bucket all-reduced once, in order"
        twin.zero_grad(set_to_none=True)
        for x in data:
            (twin(x, rank) / MICROBATCHES).backward()
        for (name, param), reference in zip(net.named_parameters(), twin.parameters()):
            if name == "unused":
                assert param.grad is None, "no replica had a gradient: None, as in single-device training"
                continue
            mine = reference.grad if reference.grad is not None else torch.zeros_like(reference)
            both = [torch.zeros_like(mine) for _ in range(2)]
            dist.all_gather(both, mine)
            torch.testing.assert_close(param.grad, (both[0] + both[1]) / 2, rtol=1e-6, atol=1e-7, msg=name)
        buckets.zero()
        assert all(p.grad is not None and not p.grad.any() for p in net.parameters())
    net.zero_grad(set_to_none=True)  # e.g. Lightning's on_validation_model_zero_grad
    buckets.attach()
    assert all(p.grad is not None for p in net.parameters()), "attach() points the gradients at the buckets again"
    buckets.close()
    dist.destroy_process_group()


def _rank_launch(rank: int, store: str) -> None:
    """2BW's REDUCE: batch 0's buckets are launched (in flight), batch 1 accumulates into the other set meanwhile;
    completing batch 0 gives its average, and batch 1's gradients are its own (nothing carried over)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    buckets = GradientBuckets(list(net.parameters()), dist.group.WORLD, size=2, limit=16)
    batches = [torch.full((2, 4), float(1 + rank + 10 * b)) for b in range(2)]
    expected = []
    for x in batches:
        twin = nn.Linear(4, 3)
        twin.load_state_dict(net.state_dict())
        twin(x).sum().backward()
        both = [[torch.zeros_like(p) for _ in range(2)] for p in twin.parameters()]
        for gathered, p in zip(both, twin.parameters()):
            dist.all_gather(gathered, p.grad)
        expected.append([(a + b) / 2 for a, b in both])
    buckets.arm()
    net(batches[0]).sum().backward()
    launched = buckets.launch()
    assert all(not p.grad.any() for p in net.parameters()), "the next batch starts from zero, in the other set"
    net(batches[1]).sum().backward()  # accumulates while batch 0's all-reduces are in flight
    averaged = buckets.complete(launched)
    for p, want in zip(net.parameters(), expected[0]):
        torch.testing.assert_close(averaged[id(p)], want)
    buckets.arm()  # batch 1's buckets: the last backward already ran, so launch starts them all
    second = buckets.complete(buckets.launch())
    for p, want in zip(net.parameters(), expected[1]):
        torch.testing.assert_close(second[id(p)], want)
    buckets.close()
    dist.destroy_process_group()


def test_launched_buckets_finish_behind_the_next_batch(tmp_path):
    mp.spawn(_rank_launch, args=(str(tmp_path / "store"),), nprocs=2)


def test_buckets_start_in_the_backward_and_average_like_autograd(tmp_path):
    mp.spawn(_rank, args=(str(tmp_path / "store"),), nprocs=2)


def test_sparse_gradients_land_dense_in_their_bucket(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        embedding = nn.Embedding(10, 4, sparse=True)
        buckets = GradientBuckets(list(embedding.parameters()), dist.group.WORLD, size=1)
        for tokens in ([1, 2], [2, 3]):
            embedding(torch.tensor(tokens)).sum().backward()
        finish(buckets)
        expected = torch.zeros(10, 4)
        expected[[1, 3]] = 1.0
        expected[2] = 2.0
        assert embedding.weight.grad.layout == torch.strided
        assert torch.equal(embedding.weight.grad, expected)
        embedding.weight.grad = None  # set aside, then a sparse gradient arrives: it is moved into the bucket
        embedding(torch.tensor([4])).sum().backward()
        assert embedding.weight.grad.layout == torch.strided and embedding.weight.grad[4].eq(1).all()
        buckets.close()
    finally:
        dist.destroy_process_group()


def test_a_rebuilt_owner_takes_the_parameters_over(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        layer = nn.Linear(3, 3)
        old = GradientBuckets(list(layer.parameters()), dist.group.WORLD, size=1)
        new = GradientBuckets(list(layer.parameters()), dist.group.WORLD, size=1)
        layer(torch.ones(2, 3)).sum().backward()
        assert len(old.arrived) == 0 and len(new.arrived) == 2, "only the newest owner's hooks run"
        assert any(layer.weight.grad is view for bucket in new.buckets for view in bucket.views)
        grad_buckets.release(list(layer.parameters()))  # rebuilt without replicas: no hooks left
        layer.zero_grad(set_to_none=True)
        layer(torch.ones(2, 3)).sum().backward()
        assert len(new.arrived) == 2 and layer.weight.grad is not None
        assert not any(layer.weight.grad is view for bucket in new.buckets for view in bucket.views)
        new.close()
    finally:
        dist.destroy_process_group()


def _rank_sharded(rank: int, store: str) -> None:
    """Sharded gradients (``shard_gradients``): each bucket's parts go to their owners by ``dist.reduce`` (no
    all-reduce); an owner's gradient is the replicas' average, a non-owner's is None; a parameter no optimizer
    steps (no owner) is all-reduced to every replica; one no replica used stays None on its owner."""
    from lightning_pd2bw.engine.updates.sharding import OptimizerShards

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)
    net, twin = Net(), Net()
    twin.load_state_dict(net.state_dict())
    unowned = net.layers[2].bias  # e.g. a frozen optimizer's: in no optimizer, so no replica owns it
    stepped = [p for p in net.parameters() if p is not unowned]
    shards = OptimizerShards.build(stepped, rank, [0, 1], dist.group.WORLD)
    owner_of = {id(p): o for p, o in zip(stepped, shards.owners)}
    calls: list[str] = []
    originals = {name: getattr(dist, name) for name in ("all_reduce", "reduce")}
    for name, call in originals.items():
        dist.__dict__[name] = lambda *a, _name=name, _call=call, **k: calls.append(_name) or _call(*a, **k)
    try:
        buckets = GradientBuckets(list(net.parameters()), dist.group.WORLD, size=2, limit=6 * 6 * 4, shards=shards)
        assert buckets.sharded
        for bucket in buckets.buckets:  # each owner's parameters together, the same layout on both ranks
            owners = [owner_of.get(id(p), -1) for p in bucket.params]
            assert owners == sorted(owners)
        data = [torch.randn(5, 6, generator=torch.Generator().manual_seed(10 + rank + j)) for j in range(2)]
        for j, x in enumerate(data):
            if j == len(data) - 1:
                buckets.arm()  # the last backward starts each bucket's reduces
            (net(x, rank) / 2).backward()
        averaged = buckets.complete(buckets.launch())
        for x in data:
            (twin(x, rank) / 2).backward()
    finally:
        for name, call in originals.items():
            dist.__dict__[name] = call
    segments = sum(len(bucket.segments) for bucket in buckets.buckets)
    assert calls.count("reduce") == segments - 1 and calls.count("all_reduce") == 1, calls
    for (name, param), reference in zip(net.named_parameters(), twin.parameters()):
        mine = reference.grad if reference.grad is not None else torch.zeros_like(reference)
        both = [torch.zeros_like(mine) for _ in range(2)]
        dist.all_gather(both, mine)
        owner = owner_of.get(id(param), -1)
        assert buckets.holds(param) == (owner in (-1, rank)), name
        if name == "unused" or owner not in (-1, rank):
            assert averaged[id(param)] is None, name
        else:
            torch.testing.assert_close(averaged[id(param)], (both[0] + both[1]) / 2, rtol=1e-6, atol=1e-7, msg=name)
    buckets.close()
    dist.destroy_process_group()


def test_sharded_gradients_are_reduced_to_their_owners(tmp_path):
    mp.spawn(_rank_sharded, args=(str(tmp_path / "store"),), nprocs=2)
