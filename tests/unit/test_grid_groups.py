"""``grid.build_groups`` on 4 gloo ranks (2 stages x 2 replicas, a tied pair): each rank creates only the groups it
is a member of (before 0.14.0 every rank created every group of the run, ~100 at 64 ranks), each group holds the
ranks ``grid.communicator`` names and works, and ``Groups.mesh`` is a ``DeviceMesh`` over the same replica and
pipeline groups (dimensions ``dp`` and ``pp``), with this rank at its coordinates."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_pd2bw.engine import grid as grid_module
from lightning_pd2bw.engine.grid import ProcessGrid, build_groups, communicator

STAGES, WIDTH = 2, 2


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
        groups = build_groups(grid, [(0, 1)])
    finally:
        grid_module.dist.new_group = new_group
    assert created and all(rank in ranks for ranks in created), created  # only its own groups
    mine = {
        name: communicator(name, grid.stage, grid.replica, STAGES, WIDTH, tied=(0, 1))[1]
        for name in ("pipeline", "loss", "replica", "shard", "tied")
    }
    assert len(created) == len(mine) + 1, created  # and its one link to its neighbour
    for name, group in [("pipeline", groups.pipeline), ("loss", groups.loss), ("replica", groups.replica),
                        ("shard", groups.shard), ("tied", groups.shared[(0, 1)])]:  # fmt: skip
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
