"""Every collective's tensors on the group's device, no host sync per step, the GPU-side failure paths
(issue: the GPT-13B recipe's first multi-GPU step). On a CPU the "device" is played by the meta device: a tensor
left on the CPU where the stage's device is meant shows up as a device mismatch, as it would under NCCL."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_pd2bw import PipeDream2BWStrategy
from lightning_pd2bw.checkpoint.store import SHARED_PROBE, check_shared
from lightning_pd2bw.lightning.preemption import Preemption
from lightning_pd2bw.observe import flight_recorder
from lightning_pd2bw.sparsity.masks import MaskUpdate, Sparsifier


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class Seen(Exception):
    pass


def recording(devices):
    def all_reduce(tensor):
        devices.append(tensor.device)
        raise Seen  # the device is what this test checks; a meta tensor has no values to go on with

    return all_reduce


@pytest.mark.parametrize("allocation", ["global"])
def test_sparsity_counts_are_built_on_the_stages_device_even_without_targets(allocation):
    """A stage that holds none of the targeted weights (an embedding alone) still takes part in every sum over the
    stages; its counts were built on the CPU, which NCCL refuses. They live on the stage's device now."""
    net = nn.Linear(4, 4, device="meta")  # the weight lives on another stage
    devices = []
    sparsifier = Sparsifier({"weight": net.weight}, allocation, all_reduce=recording(devices), device="meta")
    with pytest.raises(Seen):
        sparsifier.measure()
    with pytest.raises(Seen):
        sparsifier.update(1, MaskUpdate("magnitude", density=0.5))
    assert devices == [torch.device("meta"), torch.device("meta")]


def test_the_preemption_flag_lives_on_the_host(one_process_group):
    """The per-step SIGTERM agreement reads a result on the host (no device sync per step), whatever the stage's
    device; the flag was a device tensor read with ``.item()`` every step."""
    preemption = Preemption(trainer=None, device=torch.device("meta"))
    preemption.check()
    work, flag = preemption._pending
    assert flag.device.type == "cpu"
    assert preemption.settle() is False
    preemption.received = True
    preemption.check()
    assert preemption.settle() is True


def test_a_checkpoint_folder_that_some_rank_cannot_see_is_an_error(tmp_path):
    """Rank 0 alone lists and publishes a checkpoint, so a folder local to each host loses the other hosts' shards
    silently. The first save checks that every rank reads the token rank 0 wrote (here rank 1, on another host,
    reads nothing)."""
    tmp = tmp_path / "epoch=0-step=3.ckpt.tmp"
    tmp.mkdir()
    calls = []

    def gather(obj):  # rank 0's view of an all_gather_object with rank 1 on a host without the folder
        calls.append(obj)
        return [obj, None] if len(calls) == 1 else [obj, (False, "node-b")]

    with pytest.raises(RuntimeError, match="rank 1 on node-b cannot see .*local to each host"):
        check_shared(tmp, True, gather)
    assert not (tmp / SHARED_PROBE).exists()

    def everyone_sees(obj):
        return [obj, None] if not isinstance(obj, tuple) else [obj, obj]

    other = tmp_path / "shared" / "a.ckpt.tmp"
    other.mkdir(parents=True)
    check_shared(other, True, everyone_sees)
    check_shared(other, True, lambda obj: pytest.fail("checked once per folder"))


def test_the_checkpoint_folder_is_checked_at_start_up_before_the_first_step(tmp_path):
    """Issue 48: the probe runs when the strategy binds its checkpoints at setup (fitting), in every checkpoint
    callback's folder (rank 0 creates it), not at the first save hours in; that save then checks nothing again."""
    from types import SimpleNamespace

    from lightning_pd2bw.lightning.checkpoints import StageCheckpoints

    folder = tmp_path / "run" / "checkpoints"
    calls = []

    def blind(obj):  # rank 1, on another host, reads nothing
        calls.append(obj)
        return [obj, obj] if len(calls) < 3 else [obj, (False, "node-b")]

    trainer = SimpleNamespace(
        state=SimpleNamespace(fn="fit"),
        checkpoint_callbacks=[SimpleNamespace(dirpath=str(folder))],
        is_global_zero=True,
    )
    checkpoints = StageCheckpoints()
    checkpoints._gather_objects = blind
    with pytest.raises(RuntimeError, match="rank 1 on node-b cannot see .*checkpoints"):
        checkpoints.bind(engine=None, trainer=trainer)
    assert folder.is_dir() and not (folder / SHARED_PROBE).exists()
    checkpoints._gather_objects = lambda obj: [obj, obj]
    checkpoints.bind(engine=None, trainer=trainer)
    tmp = folder / "epoch=0-step=3.ckpt.tmp"
    tmp.mkdir()
    check_shared(tmp, True, lambda obj: pytest.fail("the folder was checked at start-up"))


def test_the_flight_recorder_is_on_and_the_users_settings_win(monkeypatch, tmp_path):
    for key in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TORCH_FR_DUMP_TEMP_FILE", "/mine/trace_")
    monkeypatch.delenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", raising=False)
    flight_recorder.enable_flight_recorder(str(tmp_path))
    import os

    assert int(os.environ["TORCH_FR_BUFFER_SIZE"]) > 0 and os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == "/mine/trace_"
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "nccl_trace_rank_")


def test_no_nccl_no_abort(one_process_group):
    assert flight_recorder.abort_nccl(0) is None
    dist.all_reduce(torch.ones(1))  # the group is untouched


@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_half_precision_weights_are_refused_by_name(precision):
    import lightning as L

    import lightning_pd2bw  # noqa: F401

    with pytest.raises(ValueError, match=f"precision='{precision}' is not supported by strategy='pd2bw'.*bf16-mixed"):
        L.Trainer(strategy="pd2bw", precision=precision, devices=2, accelerator="cpu", logger=False)


def test_a_gloo_group_that_does_not_connect_names_the_interface_setting(monkeypatch):
    """Issue 48: the strategy checks its gloo groups at start-up with a bounded barrier (``checks.check_host_groups``
    from ``setup_environment``); one that cannot connect ends with GLOO_SOCKET_IFNAME named, not a 30-minute wait."""
    import torch.distributed as dist

    from lightning_pd2bw.lightning import checks

    calls = []

    def unreachable(group=None, timeout=None, wait_all_ranks=False):
        calls.append(timeout.total_seconds())
        raise RuntimeError("[Rank 0]: Ranks 5, 6 failed to pass monitoredBarrier in 120000 ms")

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "monitored_barrier", unreachable)
    group = object()
    with pytest.raises(RuntimeError, match="Ranks 5, 6 failed.*GLOO_SOCKET_IFNAME.*NCCL_SOCKET_IFNAME"):
        checks.check_host_groups([group, group, None])
    assert calls == [checks.GLOO_CHECK_SECONDS], "one bounded barrier per distinct group"


@pytest.mark.parametrize("given", [None, "backend:cudaMallocAsync"])
def test_the_strategy_sets_expandable_segments_where_the_user_did_not(monkeypatch, given):
    """2BW's versions and set-aside gradients fragment the CUDA allocator's fixed segments: the launcher sets
    ``expandable_segments`` before any allocation (inherited by the processes it starts), never over a user's value."""
    import lightning.pytorch as pl

    import lightning_pd2bw
    from lightning_pd2bw.lightning.processes import ALLOCATOR_CONF

    if given is None:
        monkeypatch.delenv(ALLOCATOR_CONF[0], raising=False)
    else:
        monkeypatch.setenv(ALLOCATOR_CONF[0], given)
    pl.Trainer(strategy=lightning_pd2bw.PipeDream2BWStrategy(), accelerator="cpu", devices=1, logger=False, max_steps=1)
    assert os.environ[ALLOCATOR_CONF[0]] == (given or "expandable_segments:True")


@pytest.mark.parametrize("visible,expected", [(1, 0), (8, 5)], ids=["one GPU per task (SLURM)", "the node's GPUs"])
def test_each_rank_finds_its_gpu_whether_it_sees_one_or_all(monkeypatch, visible, expected):
    """Issue 95: local rank 5 on a node of 8 GPUs. With SLURM's --gpus-per-task=1 each task sees only its own GPU, as
    device 0 (cuda:LOCAL_RANK would not exist); with all of the node's GPUs visible it takes the fifth."""
    from lightning_pd2bw.engine.comm.grid import default_device

    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    assert default_device() == torch.device("cuda", expected)
    strategy = PipeDream2BWStrategy(parallel_devices=[torch.device("cuda", i) for i in range(8)])
    monkeypatch.setattr(type(strategy), "local_rank", property(lambda self: 5))
    assert strategy.root_device == torch.device("cuda", expected)
