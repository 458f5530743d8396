from __future__ import annotations

import torch
from torch import nn

from lightning_pd2bw.engine.versions import WeightVersions


def test_double_buffer_holds_two_versions_and_swaps_without_copy():
    param = nn.Parameter(torch.zeros(3))
    versions = WeightVersions([param], double_buffer=True)
    for step in range(5):
        versions.begin_update()
        with torch.no_grad():
            param.add_(1.0)  # the "optimizer step" writes version step + 1
        assert versions.num_versions == (2 if step >= 0 else 1)
        versions.use(versions.latest - 1)
        assert param.data.eq(step).all(), "the previous version is intact"
        storage = param.data.data_ptr()
        versions.use(versions.latest)
        versions.use(versions.latest - 1)
        assert param.data.data_ptr() == storage, "switching back and forth is a pointer swap"
    assert versions.max_versions_held == 2


def test_reset_after_drain_keeps_only_newest():
    param = nn.Parameter(torch.zeros(2))
    versions = WeightVersions([param], double_buffer=True)
    versions.begin_update()
    with torch.no_grad():
        param.fill_(7.0)
    versions.reset_after_drain()
    assert versions.num_versions == 1
    versions.use(0)
    assert param.data.eq(7.0).all()
