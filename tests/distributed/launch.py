"""Launch ``run_cases.py`` under torchrun once per world size and cache the outputs for the session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

RUNNER = Path(__file__).with_name("run_cases.py")
ROOT = Path(__file__).resolve().parents[2]


def torchrun(out: Path, world: int, cases: list[str], timeout: float = 600) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={world}",
        "--standalone",
        str(RUNNER),
        str(out),
        *cases,
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if result.returncode != 0:
        raise AssertionError(
            f"torchrun failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
        )
