"""``ckpt_path=last`` in the ranks Lightning's launcher starts: the job's first process chooses and writes
``config.yaml`` before it starts them, so a rank judging that file by its own start time took its own job for an
earlier one and refused ("this run was started before") whenever it started more than the clock's slack after the
write (seen under a loaded machine). The ranks now take their parent's choice."""

from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

from lightning_pd2bw.cli import run_folder


def _cfg(out):
    return OmegaConf.create({"ckpt_path": "last", "paths": {"output_dir": str(out)}, "callbacks": {}})


def test_a_launched_rank_takes_its_parents_choice_not_its_jobs_config(tmp_path, monkeypatch):
    monkeypatch.setenv(run_folder.CHOSEN, "")  # restored after the test
    first = _cfg(tmp_path)
    run_folder.resolve_last_checkpoint(first)  # the job's first process: nothing there, a fresh start
    assert first.ckpt_path is None
    (tmp_path / "config.yaml").write_text("written by the first process, before it starts the ranks\n")
    parent = os.getpid()
    # a rank it started: its parent is the first process, and it started after the write
    monkeypatch.setattr(run_folder.os, "getpid", lambda: parent + 1)
    monkeypatch.setattr(run_folder.os, "getppid", lambda: parent)
    rank = _cfg(tmp_path)
    run_folder.resolve_last_checkpoint(rank)
    assert rank.ckpt_path is None
    # another run into the folder (not a child of the first process): config.yaml from before it started refuses
    monkeypatch.setattr(run_folder.os, "getppid", lambda: parent + 2)
    monkeypatch.setattr(run_folder.os, "getpid", lambda: parent)  # its own start time: this test's, after the write
    os.utime(tmp_path / "config.yaml", (0, 0))
    with pytest.raises(Exception, match="this run was started before"):
        run_folder.resolve_last_checkpoint(_cfg(tmp_path))
