from __future__ import annotations

import torch
from torch import nn

from lightning_pd2bw.engine.state.versions import WeightVersions


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


# ---------------------------------------------------------------------------------------------- bfloat16 versions
def _mixed(double_buffer: bool = True) -> tuple[nn.Parameter, WeightVersions]:
    param = nn.Parameter(torch.tensor([1.0, 2.0, 3.0]) + 1 / 1024)  # not exact in bfloat16: rounding shows
    return param, WeightVersions([param], double_buffer=double_buffer, compute_dtype=torch.bfloat16)


def test_compute_runs_on_bfloat16_versions_and_the_update_on_the_float32_master():
    param, versions = _mixed()
    assert versions.mixed and param.dtype == torch.float32, "at rest: the master"
    versions.use(0)
    assert param.dtype == torch.bfloat16 and param.data.equal(torch.tensor([1.0, 2.0, 3.0]).add(1 / 1024).bfloat16())
    versions.begin_update()  # the update steps the master in place
    assert param.dtype == torch.float32
    with torch.no_grad():
        param.add_(10.0)
    versions.use(versions.latest - 1 - versions.drain_base)  # in flight: the previous version, untouched
    assert param.data.float().lt(5).all()
    versions.use(versions.latest - versions.drain_base)  # the new one: cast from the master when first used
    assert param.data.equal((torch.tensor([1.0, 2.0, 3.0]) + 1 / 1024 + 10.0).bfloat16())
    assert versions.num_versions == 2 and versions.held_bytes == 3 * (4 + 2 + 2)


def test_a_write_to_the_master_at_rest_reaches_the_next_compute():
    """What runs between the engine's calls (a checkpoint load, a callback) writes the master; the version compute
    uses next is cast from it (the resume of a bf16 run read stale initial weights before this was so)."""
    param, versions = _mixed()
    with torch.no_grad():
        param.copy_(torch.tensor([8.0, 8.0, 8.0]))  # before the first compute (a resume's load)
    versions.use(0)
    assert param.data.eq(8.0).all()
    versions.rest()
    with torch.no_grad():
        param.copy_(torch.tensor([5.0, 6.0, 7.0]))  # between two batches (a callback)
    versions.use(0)
    assert param.data.equal(torch.tensor([5.0, 6.0, 7.0], dtype=torch.bfloat16))


def test_a_version_in_flight_keeps_what_the_master_held_when_the_update_began():
    """Written at rest, then an update begins before any compute read the version: the version in flight is cast
    from the master first, so the step's change never leaks into it."""
    param, versions = _mixed()
    versions.rest()
    with torch.no_grad():
        param.fill_(4.0)
    versions.begin_update()
    with torch.no_grad():
        param.fill_(9.0)  # the step
    versions.use(0)
    assert param.data.eq(4.0).all()


def test_a_float32_gradient_accumulates_a_bfloat16_version_s_gradients():
    param, versions = _mixed()
    param.grad = torch.zeros(3)  # on the master: float32
    versions.use(0)
    for _ in range(2):
        (param * torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)).sum().backward()
    assert param.grad.dtype == torch.float32 and param.grad.equal(torch.tensor([2.0, 4.0, 6.0]))


def test_bfloat16_versions_under_flush_hold_one_version_and_the_master():
    param, versions = _mixed(double_buffer=False)
    for _ in range(3):
        versions.begin_update()
        with torch.no_grad():
            param.add_(1.0)
        versions.reset_after_drain()  # flush drains after every batch
        versions.use(0)
    assert versions.num_versions == 1 and param.data.float().sub(torch.tensor([4.0, 5.0, 6.0])).abs().max() < 0.02


def test_only_the_owned_parameters_keep_a_float32_master():
    """Issue 77: ``owned`` (the sharded optimizer's share) keeps its float32 master; another replica's parameter lives
    in the bf16 versions alone. At rest and during the update it shows its newest version (at ``begin_update`` a copy
    of the last, what hooks read); ``publishable`` casts the owned masters into the newest version (the broadcasts'
    messages); computing on a version reads owned casts refreshed from the master."""
    mine, theirs = nn.Parameter(torch.tensor([1.0, 2.0])), nn.Parameter(torch.tensor([3.0, 4.0]))
    versions = WeightVersions([mine, theirs], double_buffer=True, compute_dtype=torch.bfloat16, owned=[mine])
    assert versions.sharded_master and versions.unmastered() == [theirs]
    assert versions.master_bytes == 2 * 4 and mine.dtype == torch.float32 and theirs.dtype == torch.bfloat16
    versions.begin_update()
    assert theirs.dtype == torch.bfloat16 and torch.equal(theirs.data, torch.tensor([3.0, 4.0], dtype=torch.bfloat16))
    with torch.no_grad():
        mine.add_(0.5)  # the owner's step on its master
        theirs.copy_(torch.tensor([5.0, 6.0]))  # the owner's broadcast arriving here
    sent = versions.publishable([mine, theirs])
    assert torch.equal(sent[0], torch.tensor([1.5, 2.5], dtype=torch.bfloat16))
    assert sent[1].data_ptr() == theirs.data.data_ptr()  # in place: where the broadcast lands
    versions.use(1)  # the new version, for compute
    assert torch.equal(mine.data, sent[0]) and torch.equal(theirs.data, torch.tensor([5.0, 6.0], dtype=torch.bfloat16))
    versions.use(0)  # the version in-flight microbatches still read: untouched
    assert torch.equal(mine.data, torch.tensor([1.0, 2.0], dtype=torch.bfloat16))
    assert torch.equal(theirs.data, torch.tensor([3.0, 4.0], dtype=torch.bfloat16))
    versions.rest()
    assert mine.dtype == torch.float32 and torch.equal(mine.data, torch.tensor([1.5, 2.5]))
