"""``Collective.issue`` (``engine/updates/collectives.py``) on two gloo ranks: a part's declaration is what travels. Each
declared op against its plain ``torch.distributed`` meaning, computed apart from the values each rank holds: the
all-reduce's sum and (``maximum``, the non-finite flags) its max, the reduce to a root and the broadcast from one;
a reduce or broadcast declared without its root is refused by name. The parts' own declarations issue through it
(``TiedSums``, ``SkipNonFinite``, the buckets' and the owners' broadcasts); the recorded-trace tests check the order."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_pd2bw.engine.schedules import actions as A
from lightning_pd2bw.engine.updates.collectives import Collective, CollectiveOp, GroupName
from lightning_pd2bw.engine.updates.grad_buckets import GradientBuckets
from lightning_pd2bw.engine.updates.sharding import OptimizerShards
from lightning_pd2bw.engine.updates.update_parts import GlobalNormClip, SkipNonFinite, TiedSums


def _rank(rank: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    group = dist.group.WORLD
    mine = torch.tensor([1.0 + rank, 5.0 - 3 * rank])  # rank 0: [1, 5]; rank 1: [2, 2]
    summed = mine.clone()
    TiedSums.SUM.issue(summed, group).wait()
    assert summed.tolist() == [3.0, 7.0]
    flag = mine.clone()
    SkipNonFinite.FLAG.issue(flag, group).wait()
    assert flag.tolist() == [2.0, 5.0], "the flags' declaration takes the maximum"
    to_root = mine.clone()
    GradientBuckets.TO_OWNER.issue(to_root, group, root=1).wait()
    if rank == 1:
        assert to_root.tolist() == [3.0, 7.0]
    sent = mine.clone()
    OptimizerShards.WEIGHTS.issue(sent, group, root=0).wait()
    assert sent.tolist() == [1.0, 5.0]
    dist.destroy_process_group()


def test_each_declared_op_is_what_is_issued(tmp_path):
    mp.spawn(_rank, args=(str(tmp_path / "store"),), nprocs=2, join=True)


def test_a_rooted_collective_without_its_root_is_refused():
    declared = Collective(CollectiveOp.BROADCAST, GroupName.SHARD, "weights of 1", A.STEP, A.PUBLISH)
    with pytest.raises(ValueError, match="weights of 1: a broadcast needs its root rank"):
        declared.issue(torch.zeros(1), group=None)


def test_the_parts_declare_the_objects_they_issue():
    """Each part's ``collectives`` returns the very declarations its handlers issue (only repeat and names vary)."""
    from lightning_pd2bw.engine.updates.stepper import Stepper
    from lightning_pd2bw.engine.updates.update import UpdateShape
    from lightning_pd2bw.engine.updates.update_parts import BucketReducer

    shape = UpdateShape(True, 2, buckets=3, tied=True, sharded=True, owners_broadcast=True, nonfinite="skip")
    assert TiedSums.collectives(shape) == [TiedSums.SUM, TiedSums.AVERAGE]
    assert SkipNonFinite.collectives(shape) == [SkipNonFinite.OWNERS, SkipNonFinite.FLAG]
    assert GlobalNormClip.collectives(shape) == [GlobalNormClip.OWNERS, GlobalNormClip.NORM]
    (reduces,) = BucketReducer.collectives(shape)
    assert reduces == GradientBuckets.TO_OWNER.times(6, reclaimed=True)
    assert [c.times(1, what="weights") for c in Stepper.collectives(shape)] == [OptimizerShards.WEIGHTS] * 2
