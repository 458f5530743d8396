"""``placement`` (``layout.Placement``, ``grid.ProcessGrid``): which ranks are neighbours. Against the rule written
out by hand for a 3-stage x 2-replica world: by pipeline, ranks 0-2 are replica 0's stages; by replicas, ranks 0-1
are stage 0's replicas. Every rank's neighbours, groups and data shard follow from its (stage, replica), and the
communicators every rank builds (``grid.communicator``) are the groups the grid names."""

from __future__ import annotations

import pytest

from lightning_pd2bw.engine.comm.grid import ProcessGrid, communicator
from lightning_pd2bw.engine.layout import Placement
from lightning_pd2bw.engine.options import PipelineOptions

STAGES, WIDTH = 3, 2
BY_HAND = {  # rank -> (stage, replica)
    "pipeline": {0: (0, 0), 1: (1, 0), 2: (2, 0), 3: (0, 1), 4: (1, 1), 5: (2, 1)},
    "replicas": {0: (0, 0), 1: (0, 1), 2: (1, 0), 3: (1, 1), 4: (2, 0), 5: (2, 1)},
}


@pytest.mark.parametrize("placement", ["pipeline", "replicas"])
def test_each_rank_sits_where_the_rule_says(placement):
    where = BY_HAND[placement]
    rank_at = {position: rank for rank, position in where.items()}
    for rank, (stage, replica) in where.items():
        grid = ProcessGrid(rank, STAGES * WIDTH, STAGES, placement)
        assert (grid.stage, grid.replica) == (stage, replica)
        assert grid.pipeline_ranks() == [rank_at[(s, replica)] for s in range(STAGES)]
        assert grid.replica_ranks() == [rank_at[(stage, r)] for r in range(WIDTH)]
        assert grid.prev_rank == (rank_at[(stage - 1, replica)] if stage else None)
        assert grid.next_rank == (rank_at[(stage + 1, replica)] if stage < STAGES - 1 else None)
        assert grid.describe() == f"rank {rank} (stage {stage} of {STAGES}, replica {replica})"
        _, pipeline = communicator("pipeline", stage, replica, STAGES, WIDTH, placement=Placement(placement))
        _, replicas = communicator("replica", stage, replica, STAGES, WIDTH, placement=Placement(placement))
        _, link = communicator("p2p", min(stage, STAGES - 2), replica, STAGES, WIDTH, placement=Placement(placement))
        assert list(pipeline) == grid.pipeline_ranks() and list(replicas) == grid.replica_ranks()
        assert rank in link and all(where[r][1] == replica for r in link)


def test_a_placement_that_is_not_one_is_refused_by_name():
    with pytest.raises(
        ValueError, match=r"PipelineOptions\(placement='servers'\) is invalid; valid: pipeline, replicas"
    ):
        PipelineOptions(placement="servers")


def test_the_planner_times_each_placement_by_hand():
    """2 servers x 8 devices, 4 stages x 4 replicas, B bytes of gradients, latency 0. By pipeline (ranks r*4 + s):
    stage 0's replicas are ranks 0, 4, 8, 12, two per server, and the four stages of a server share its network link:
    a 2-way ring inside (B/2 over NVLink, twice) plus a 2-way ring across carrying 4 stages' traffic; every boundary
    inside a server. By replicas (ranks s*4 + r): stage 0's replicas are ranks 0-3, one server, one 4-way ring over
    NVLink; the boundary after stage 1 (ranks 4-7 on server 0 to 8-11 on server 1) leaves server 0 four times."""
    from lightning_pd2bw.planner import Candidate, ClusterSpec, DeviceSpec
    from lightning_pd2bw.planner.timing import allreduce_time, link_bandwidth

    intra, inter, size = 1e10, 1e9, 1e8
    cluster = ClusterSpec(DeviceSpec("toy", 1e12, 10 << 30, 1e11), 2, 8, intra, inter, latency=0.0)
    by_pipeline = Candidate.of(PipelineOptions(placement="pipeline"), 4, 4, 1, False)
    by_replicas = Candidate.of(PipelineOptions(placement="replicas"), 4, 4, 1, False)
    assert allreduce_time(size, by_pipeline, cluster) == pytest.approx(size / intra + size * 4 / inter)
    assert allreduce_time(size, by_replicas, cluster) == pytest.approx(2 * 3 / 4 * size / intra)
    assert [link_bandwidth(by_pipeline, cluster, b) for b in range(3)] == [intra] * 3
    assert [link_bandwidth(by_replicas, cluster, b) for b in range(3)] == [intra, inter / 4, intra]
    unplaced = Candidate.of(PipelineOptions(), 4, 4, 1, False)  # None: timed as the grid runs it, by pipeline
    assert allreduce_time(size, unplaced, cluster) == allreduce_time(size, by_pipeline, cluster)


def test_the_planner_weighs_both_placements_only_where_the_run_leaves_it():
    from lightning_pd2bw.planner.search import candidates

    left = {c.options.placement for c in candidates(16, 8, 64, PipelineOptions()) if c.width > 1 and c.depth > 1}
    given = {c.options.placement for c in candidates(16, 8, 64, PipelineOptions(placement="replicas"))}
    assert left == {"pipeline", "replicas"} and given == {"replicas"}
    assert all(c.options.placement is None for c in candidates(16, 8, 64, PipelineOptions()) if c.width == 1)
