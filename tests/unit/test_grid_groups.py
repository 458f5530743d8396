"""``grid.build_groups`` on 6 gloo ranks (3 stages x 2 replicas, the first and last tied), with a ``new_group`` per
group and with one ``split_group`` per kind (NCCL's path, its split played on gloo): every rank creates every
group in the same order, each group this rank is in holds the ranks ``grid.communicator`` names and sums over them,
and ``Groups.mesh`` is a ``DeviceMesh`` over the same replica and pipeline groups (dimensions ``dp`` and ``pp``),
with this rank at its coordinates. Three stages: a middle stage holds two links where the others hold one (what
``use_local_synchronization``'s group names cannot take, ``Groups``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_pd2bw.engine.comm import grid as grid_module
from lightning_pd2bw.engine.comm.grid import ProcessGrid, build_groups, communicator, group_kinds

STAGES, WIDTH = 3, 2


def _rank(rank: int, store: str) -> None:
    """Both paths in one process group (one start of 6 processes): a ``new_group`` per group, then a split per kind."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=STAGES * WIDTH)
    for split in (False, True):
        _build_and_check(rank, split)
    dist.destroy_process_group()


def _build_and_check(rank: int, split: bool) -> None:
    created: list[tuple[int, ...]] = []
    splits: list[list[list[int]]] = []
    new_group, split_group = dist.new_group, dist.split_group

    def recording(ranks, *args, **kwargs):
        created.append(tuple(ranks))
        return new_group(ranks, *args, **kwargs)

    def splitting(parent_pg=None, split_ranks=None, group_desc=None, **kwargs):
        """``split_group`` as NCCL's comm split behaves, on gloo: every rank joins every part, keeps its own."""
        splits.append(split_ranks)
        made = [new_group(ranks) for ranks in split_ranks]
        return next((g for g, ranks in zip(made, split_ranks) if rank in ranks), None)

    grid_module.dist.new_group, grid_module.dist.split_group = recording, splitting
    try:
        grid = ProcessGrid(rank, STAGES * WIDTH, STAGES)
        groups = build_groups(grid, [(0, STAGES - 1)], split=split)
    finally:
        grid_module.dist.new_group, grid_module.dist.split_group = new_group, split_group
    # every group of the run, on every rank: per replica its pipeline, loss, two links and tied pair; per stage its
    # replica and shard groups; split: one call per kind (pipeline, loss, each link, replica, shard, tied)
    made = [tuple(ranks) for kind in splits for ranks in kind] if split else created
    assert len(made) == WIDTH * (2 + STAGES - 1 + 1) + 2 * STAGES, made
    assert len(splits) == (2 + (STAGES - 1) + 2 + 1 if split else 0) and (not split or not created)
    tied = (0, STAGES - 1)
    mine = {
        name: communicator(name, grid.stage, grid.replica, STAGES, WIDTH, tied=tied)[1]
        for name in ("pipeline", "loss", "replica", "shard", "tied")
    }
    held = [("pipeline", groups.pipeline), ("loss", groups.loss), ("replica", groups.replica), ("shard", groups.shard)]
    held += [("tied", groups.shared[tied])] if grid.stage in tied else []
    for name, group in held:
        assert sorted(dist.get_process_group_ranks(group)) == sorted(mine[name]), name
        total = torch.tensor([float(rank)])
        dist.all_reduce(total, group=group)
        assert total.item() == sum(mine[name]), name
    mesh = groups.mesh("cpu", STAGES, WIDTH)
    assert mesh.mesh_dim_names == ("dp", "pp") and list(mesh.get_coordinate()) == [grid.replica, grid.stage]
    assert mesh.get_group("dp") is groups.replica and mesh.get_group("pp") is groups.pipeline
    assert mesh.mesh.tolist() == [[r * STAGES + s for s in range(STAGES)] for r in range(WIDTH)]
    dist.barrier()
    groups.destroy()


def test_a_rank_creates_only_its_groups_and_the_mesh_reuses_them(tmp_path):
    mp.spawn(_rank, args=(str(tmp_path / "store"),), nprocs=STAGES * WIDTH)


def test_at_64_ranks_a_rank_holds_only_the_groups_it_uses():
    """gpt13b's 4 x 16 on 64 ranks, as ranks 0, 5 and 63 build them (torch's ``fake`` backend: one process plays a
    rank of 64, nothing is sent): every rank calls ``new_group`` for every group, but a group it is not in leaves
    nothing behind (torch returns ``NON_GROUP_MEMBER`` before any store round or communicator), so a rank's
    process groups are the default and its own, whatever the width."""
    from torch.distributed.distributed_c10d import _world
    from torch.testing._internal.distributed.fake_pg import FakeStore

    stages, world, tied = 4, 64, (0, 3)
    for rank in (0, 5, 63):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            grid = ProcessGrid(rank, world, stages)
            groups = build_groups(grid, [tied])
            names = ["pipeline", "loss", "replica", "shard", *(["tied"] if grid.stage in tied else [])]
            names += ["p2p"] * (grid.stage < stages - 1)  # its link to the next stage
            expected = {communicator(n, grid.stage, grid.replica, stages, world // stages, tied)[1] for n in names}
            if grid.stage > 0:  # its link to the previous stage
                expected.add(communicator("p2p", grid.stage - 1, grid.replica, stages, world // stages)[1])
            held = {tuple(dist.get_process_group_ranks(g)) for g in groups.members()}
            assert held == expected, rank
            assert len(_world.pg_map) == 1 + len(groups.members()) <= 8, rank  # the default group and its own
            kinds = group_kinds(grid, [tied])  # one split_group each under an eager NCCL: 8 where groups are 104
            assert len(kinds) == 8 and sum(map(len, kinds)) == 2 * 16 + 3 * 16 + 2 * 4 + 16
            for parts in kinds:  # split_group's rule: the groups of one kind share no rank
                members = [r for _, ranks in parts for r in ranks]
                assert len(members) == len(set(members))
        finally:
            dist.destroy_process_group()


def test_group_creation_chooses_the_groups_path(tmp_path, monkeypatch):
    """``strategy.group_creation`` (issue 95): ``split`` leaves the choice to ``eager_nccl()`` (None), ``new_group``
    forces a group at a time; anything else is refused by name."""
    import pytest
    from torch import nn

    from lightning_pd2bw.engine import build as build_module
    from lightning_pd2bw.engine.options import PipelineOptions

    with pytest.raises(ValueError, match=r"group_creation='splt'\) is invalid; valid: split, new_group"):
        PipelineOptions(group_creation="splt")
    from lightning_pd2bw.engine import engine as engine_module

    seen = []
    built = build_module.build_stage
    monkeypatch.setattr(engine_module, "build_stage", lambda *a: seen.append(a[-1]) or built(*a))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for choice in ("split", "new_group"):
            options = PipelineOptions(num_stages=1, group_creation=choice)
            engine_module.PipelineEngine([nn.Linear(2, 2)], options, lambda b: b, lambda o, b: o.sum(), device="cpu")
    finally:
        dist.destroy_process_group()
    assert seen == [None, False]  # None: split where the backend can (eager NCCL), else new_group
