"""``grid.build_groups`` on 6 gloo ranks (3 stages x 2 replicas, the first and last tied): every rank creates every
group in the same order, each group this rank is in holds the ranks ``grid.communicator`` names and sums over them,
and ``Groups.mesh`` is a ``DeviceMesh`` over the same replica and pipeline groups (dimensions ``dp`` and ``pp``),
with this rank at its coordinates. Three stages: a middle stage holds two links where the others hold one (what
``use_local_synchronization``'s group names cannot take, ``Groups``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_pd2bw.engine.comm import grid as grid_module
from lightning_pd2bw.engine.comm.grid import ProcessGrid, build_groups, communicator

STAGES, WIDTH = 3, 2


def _rank(rank: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=STAGES * WIDTH)
    created: list[tuple[int, ...]] = []
    new_group = dist.new_group

    def recording(ranks, *args, **kwargs):
        created.append(tuple(ranks))
        return new_group(ranks, *args, **kwargs)

    grid_module.dist.new_group = recording
    try:
        grid = ProcessGrid(rank, STAGES * WIDTH, STAGES)
        groups = build_groups(grid, [(0, STAGES - 1)])
    finally:
        grid_module.dist.new_group = new_group
    # every group of the run, on every rank: per replica its pipeline, loss, two links and tied pair; per stage its
    # replica and shard groups
    assert len(created) == WIDTH * (2 + STAGES - 1 + 1) + 2 * STAGES, created
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
    dist.destroy_process_group()


def test_a_rank_creates_only_its_groups_and_the_mesh_reuses_them(tmp_path):
    mp.spawn(_rank, args=(str(tmp_path / "store"),), nprocs=STAGES * WIDTH)
