"""``end_default_group``: what pd2bw-train and every rank script call before the interpreter exits (a gloo group
left up can abort the exit: SIGABRT after a passing run)."""

from __future__ import annotations

import torch.distributed as dist

from lightning_pd2bw.engine.comm.grid import end_default_group


def test_it_destroys_an_initialized_default_group_and_is_a_no_op_without_one(tmp_path):
    end_default_group()  # none up: nothing to do, no error
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    assert dist.is_initialized()
    end_default_group()
    assert not dist.is_initialized()
