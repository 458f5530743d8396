"""The fault suite an operator meets (issue 60): every layout refused before launch by the dry run's own check, and
every refusal the project raises ends with its message (no traceback, no Hydra hint) on every command line, unless
``HYDRA_FULL_ERROR=1`` asks for the trace. Crafted checkpoints on every load path: ``test_checkpoint.py``."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lightning_pd2bw.errors import Refusal, refusal_in

from ..cli import run_cli

ROOT = Path(__file__).resolve().parents[2]
HYDRA_HINT = "HYDRA_FULL_ERROR"

LAYOUTS = {
    "more stages than layers": (
        ["trainer.devices=3", "model.config.n_layer=0"],
        "the model has 2 pipeline layers but strategy.num_stages=3; use at most 2 stages",
    ),
    "more processes than layers": (
        ["trainer.devices=12", "global_batch_size=48"],
        "the model has 10 pipeline layers but strategy.num_stages=12",
    ),
    "a cut that leaves a stage empty": (
        ["strategy.num_stages=2", "strategy.layers_per_stage=[10,0]"],
        r"strategy.layers_per_stage=\[10, 0\] must be positive and sum to the model's 10 pipeline layers",
    ),
    "a cut that misses layers": (
        ["strategy.num_stages=2", "strategy.layers_per_stage=[3,3]"],
        "must be positive and sum to the model's 10 pipeline layers",
    ),
    "devices that do not divide into stages": (
        ["strategy.num_stages=3", "trainer.devices=4"],
        r"world size 4 \(trainer.devices x trainer.num_nodes\) is not a multiple of strategy.num_stages=3",
    ),
}


@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry run"])
@pytest.mark.parametrize("case", list(LAYOUTS))
def test_every_layout_is_refused_before_launch(tmp_path, case, dry_run):
    """The run and the dry run refuse alike, within seconds, naming the key and the fix; nothing is started."""
    overrides, message = LAYOUTS[case]
    started = time.monotonic()
    result = run_cli(
        *overrides, f"dry_run={str(dry_run).lower()}", f"paths.output_dir={tmp_path / 'run'}", cwd=tmp_path
    )
    assert result.returncode != 0, result.stdout
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("pd2bw-train: bad configuration: "), result.stderr
    import re

    assert re.search(message, last), last
    assert time.monotonic() - started < 30
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_refusals_are_found_through_wrappers():
    """Lightning and DCP re-raise a rank's failure wrapped: the refusal is still found (and nothing else is)."""
    try:
        try:
            raise Refusal("the reason and the fix")
        except Refusal as inner:
            raise RuntimeError("wrapped") from inner
    except RuntimeError as outer:
        assert str(refusal_in(outer)) == "the reason and the fix"
    assert refusal_in(RuntimeError("a bug")) is None
    from lightning_pd2bw.checkpoint.preflight import OutOfSpace

    full = OutOfSpace(errno.ENOSPC, "No space left")
    assert isinstance(full, OSError) and full.errno == errno.ENOSPC and refusal_in(full) is full


def _train(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "lightning_pd2bw.cli.train", *args]
    environment = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", PYTHONPATH=str(ROOT), **(env or {}))
    environment.pop("HYDRA_FULL_ERROR", None) if not env or HYDRA_HINT not in env else None
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=cwd, env=environment)


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (the checkpoints of the tiny GPT need ~80 MiB), where this machine allows mounting."""
    folder = tmp_path / "disk"
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs needs privileges this machine does not give: {mounted.stderr.decode()[-200:]}")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], capture_output=True)


@pytest.mark.full
@pytest.mark.parametrize("full_error", [False, True], ids=["message", "HYDRA_FULL_ERROR=1"])
def test_a_full_disk_ends_the_run_with_its_message(tmp_path, small_disk, full_error):
    """Disk full at the first checkpoint: every rank ends, and the last line is the refusal naming the folder and the
    free space; no traceback and no Hydra hint after it unless HYDRA_FULL_ERROR=1 asks for the trace."""
    args = [
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        "trainer.limit_val_batches=1",
        f"paths.output_dir={tmp_path / 'run'}",
        f"callbacks.model_checkpoint.dirpath={small_disk}",
        "logger=csv",
    ]
    result = _train(args, tmp_path, {HYDRA_HINT: "1"} if full_error else None)
    assert result.returncode not in (0, None), result.stderr[-3000:]
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    if full_error:
        assert "Traceback" in result.stderr and "No space left" in result.stderr, result.stderr[-3000:]
        return
    assert lines[-1].startswith("pd2bw-train: No space left on the device for checkpoint"), result.stderr[-3000:]
    assert str(small_disk) in lines[-1] and "MiB are free" in lines[-1]
    assert HYDRA_HINT not in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


@pytest.mark.full
def test_a_refusal_of_one_rank_ends_the_job_with_its_message_on_rank_0(tmp_path):
    """Issue 98 item 5: a resume whose checkpoint has rank 1's shard damaged is refused by rank 1 alone. The terminal
    ends with rank 0's one message naming rank 1 and the damaged file, code 1 (a resume would meet it again; not the
    resumable 75), no traceback or stack on it; rank 1's message and rank 0's stacks are kept in their log files."""
    args = ["trainer.max_steps=4", "trainer.limit_val_batches=0", f"paths.output_dir={tmp_path / 'run'}", "logger=csv"]
    assert _train(args, tmp_path).returncode == 0
    shard = tmp_path / "run" / "checkpoints" / "last.ckpt" / "__1_0.distcp"
    data = bytearray(shard.resolve().read_bytes())
    data[len(data) // 2 : len(data) // 2 + 48] = bytes(b ^ 0xFF for b in data[len(data) // 2 : len(data) // 2 + 48])
    shard.resolve().write_bytes(bytes(data))
    result = _train([*args, "trainer.max_steps=6", "ckpt_path=last"], tmp_path)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 1, result.stderr[-3000:]
    assert last.startswith("pd2bw: rank 1 (stage 1 of 2, replica 0) refused: checkpoint"), result.stderr[-3000:]
    assert "__1_0.distcp's bytes changed" in last and "Use another checkpoint" in last
    assert "Traceback" not in result.stderr and 'File "' not in result.stderr, result.stderr[-3000:]
    assert "__1_0.distcp's bytes changed" in (tmp_path / "run" / "train_ddp_process_1.log").read_text()
    assert 'File "' in (tmp_path / "run" / "train.log").read_text(), "rank 0's stacks are kept in its log"
