"""``placement`` (``layout.Placement``, ``grid.ProcessGrid``): which ranks are neighbours. Against the rule written
out by hand for a 3-stage x 2-replica world: by pipeline, ranks 0-2 are replica 0's stages; by replicas, ranks 0-1
are stage 0's replicas. Every rank's neighbours, groups and data shard follow from its (stage, replica), and the
communicators every rank builds (``grid.communicator``) are the groups the grid names."""

from __future__ import annotations

import pytest

from lightning_pd2bw.engine.grid import ProcessGrid, communicator
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
    with pytest.raises(ValueError, match=r"PipelineOptions\(placement='servers'\) is invalid; valid: pipeline, replicas"):
        PipelineOptions(placement="servers")
