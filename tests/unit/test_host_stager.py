"""``HostStager``: the asynchronous save's host copy, made without DCP's deep copy (which torch 2.11 cannot do for a
nested dict): every tensor copied, nested containers kept, buffers reused by the next save, and DCP writes what it
staged."""

from __future__ import annotations

import io

import torch
import torch.distributed.checkpoint as dcp

from lightning_pd2bw.checkpoint.host_stager import HostStager
from lightning_pd2bw.checkpoint.store import write_state


def state(scale: float) -> dict:
    return {
        "model/w": torch.full((3, 4), scale),
        "optim": {"0": {"exp_avg": torch.arange(6.0) * scale, "step": torch.tensor(5.0)}},
        "groups": [{"lr": 0.1, "params": [0, 1]}],
        "blob": io.BytesIO(b"trainer state"),
        "step": 7,
    }


def test_staged_copies_are_independent_and_reused():
    stager = HostStager()
    source = state(1.0)
    staged = stager.stage(source)
    source["model/w"].add_(100)  # training goes on: the staged copy must not move
    source["optim"]["0"]["exp_avg"].mul_(0)
    assert torch.equal(staged["model/w"], torch.full((3, 4), 1.0))
    assert torch.equal(staged["optim"]["0"]["exp_avg"], torch.arange(6.0))
    assert staged["groups"] == [{"lr": 0.1, "params": [0, 1]}] and staged["step"] == 7
    assert staged["blob"].getvalue() == b"trainer state" and staged["blob"] is not source["blob"]
    pointer = staged["model/w"].data_ptr()
    again = stager.stage(state(2.0))
    assert again["model/w"].data_ptr() == pointer, "the second save reuses the first one's host buffers"
    assert torch.equal(again["model/w"], torch.full((3, 4), 2.0))
    assert stager.held_bytes == (12 + 6 + 1) * 4
    stager.close()
    assert stager.held_bytes == 0


def test_an_asynchronous_save_through_it_reads_back(tmp_path):
    entries = {"model/w": torch.randn(5, 3), "optim/0/w/exp_avg": torch.randn(5, 3)}
    future = write_state(tmp_path / "ckpt", entries, asynchronous=True, stager=HostStager())
    expected = {k: v.clone() for k, v in entries.items()}
    for tensor in entries.values():
        tensor.zero_()  # after staging: not in the checkpoint
    future.result()
    loaded = {k: torch.empty_like(v) for k, v in expected.items()}
    dcp.load(loaded, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    for name in expected:
        assert torch.equal(loaded[name], expected[name]), name
