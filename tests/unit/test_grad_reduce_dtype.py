"""``grad_reduce_dtype="bfloat16"`` (``grad_buckets.py``) on two gloo ranks: the sums over the replicas travel in
bf16 and land in the float32 buckets, for the all-reduce, the reduce to each owner and 2BW's one sharded set handed
over to the next batch. The reference is independent of the buckets: each replica's plain autograd gradient (float32,
accumulated over the microbatches), each cast to bf16, their sum rounded to bf16 (what a bf16 reduce of two values
computes in any order), cast back and halved. The default (None) stays the float32 average."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_pd2bw.engine.options import PipelineOptions
from lightning_pd2bw.engine.updates.grad_buckets import GradientBuckets
from lightning_pd2bw.engine.updates.sharding import OptimizerShards


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Parameter(torch.ones(4))  # no replica's gradient: stays None
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


def _rank(rank: int, store: str, sharded: bool, double_buffered: bool, reduce_dtype: torch.dtype | None) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(0)
    net, twin = Net(), Net()
    twin.load_state_dict(net.state_dict())
    params = list(net.parameters())
    shards = OptimizerShards.build(params, rank, [0, 1], dist.group.WORLD) if sharded else None
    buckets = GradientBuckets(params, dist.group.WORLD, 2, limit=6 * 6 * 4, shards=shards, reduce_dtype=reduce_dtype)
    data = [torch.randn(5, 6, generator=torch.Generator().manual_seed(10 + rank + j)) for j in range(3)]
    for j, x in enumerate(data):
        if j == len(data) - 1:
            buckets.arm()
        (net(x) / len(data)).backward()
    launched = buckets.launch(double_buffered)
    if double_buffered:  # the next batch's first gradients: the sharded set is handed over under them
        net(data[0]).backward()
    averaged = buckets.complete(launched)
    for x in data:
        (twin(x) / len(data)).backward()
    for (name, param), reference in zip(net.named_parameters(), twin.parameters()):
        mine = reference.grad if reference.grad is not None else torch.zeros_like(reference)
        both = [torch.zeros_like(mine) for _ in range(2)]
        dist.all_gather(both, mine)
        if name == "unused" or not buckets.holds(param):
            assert averaged[id(param)] is None, name
            continue
        if reduce_dtype == torch.bfloat16:
            want = (both[0].bfloat16() + both[1].bfloat16()).float() / 2
            assert not torch.equal(want, (both[0] + both[1]) / 2), f"{name}: the bf16 sum must differ to be seen"
            torch.testing.assert_close(averaged[id(param)], want, rtol=0, atol=0, msg=name)
        else:
            torch.testing.assert_close(averaged[id(param)], (both[0] + both[1]) / 2, rtol=1e-6, atol=1e-7, msg=name)
        assert averaged[id(param)].dtype == torch.float32
    buckets.close()
    dist.destroy_process_group()


@pytest.mark.parametrize(
    "sharded, double_buffered, reduce_dtype",
    [
        (False, False, torch.bfloat16),  # an all-reduce per bucket (Flush, gradients whole)
        pytest.param(True, False, torch.bfloat16, marks=pytest.mark.full),  # a reduce to each owner
        (True, True, torch.bfloat16),  # 2BW's one sharded set, handed over to the next batch
        pytest.param(False, True, torch.bfloat16, marks=pytest.mark.full),  # 2BW, gradients whole: the spare set
        (True, True, None),  # the default: float32
    ],
)
def test_the_gradients_travel_in_bf16_and_land_in_float32(tmp_path, sharded, double_buffered, reduce_dtype):
    args = (str(tmp_path / "store"), sharded, double_buffered, reduce_dtype)
    mp.spawn(_rank, args=args, nprocs=2)


def test_only_float32_and_bfloat16_are_reduce_dtypes():
    assert PipelineOptions().grad_reduce_dtype is None
    assert PipelineOptions(grad_reduce_dtype="bfloat16").grad_reduce_dtype is torch.bfloat16
    for bad in ("float16", "bf16", torch.int8):
        with pytest.raises(ValueError, match=r"grad_reduce_dtype=.* is invalid; valid: None"):
            PipelineOptions(grad_reduce_dtype=bad)
