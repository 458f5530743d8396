"""The main job as users start it: pd2bw-train (Hydra) under Lightning's own launcher (devices=2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_pd2bw_train_two_processes_writes_run_directory(tmp_path):
    out = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "lightning_pd2bw.train",
        "model=gpt_tiny",
        "data.seq_len=32",
        "global_batch_size=8",
        "micro_batch_size=2",
        "trainer.max_steps=6",
        "trainer.val_check_interval=3",
        "trainer.limit_val_batches=1",
        "trainer.enable_progress_bar=false",
        f"paths.output_dir={out}",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-6000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["global_step"] == 6 and summary["val_loss"] < 5.6  # below uniform over bytes (ln 256)
    assert "${" not in (out / "config.yaml").read_text(), "the resolved config is saved"
    checkpoints = list(out.rglob("*.ckpt"))
    assert checkpoints and (checkpoints[0] / "stage-000.pt").is_file() and (checkpoints[0] / "stage-001.pt").is_file()
    assert not list(tmp_path.rglob("*.tmp")), "no half-written checkpoint is left behind"
