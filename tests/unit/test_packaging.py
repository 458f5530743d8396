"""The built wheel carries the configurations: installed into a clean virtual environment, ``pd2bw-train`` composes
the default recipe and ``gpt13b`` from a directory unrelated to the source checkout."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(command: list, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{command}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def test_wheel_installs_and_trains_from_anywhere(tmp_path):
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp_path, ROOT], ROOT)
    (wheel,) = tmp_path.glob("lightning_pd2bw-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for config in ("conf/config.yaml", "conf/strategy/pd2bw_2bw.yaml", "recipes/tiny.yaml", "recipes/gpt13b.yaml"):
        assert f"lightning_pd2bw/{config}" in names, config

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], tmp_path)
    python = venv / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", "--no-index", wheel], tmp_path)
    # the dependencies come from this environment's site-packages (a plain path entry: its editable install of
    # lightning_pd2bw is not activated); the package itself only from the wheel
    site = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path).stdout.strip()
    Path(site, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = run([python, "-c", "import lightning_pd2bw; print(lightning_pd2bw.__file__)"], elsewhere).stdout
    assert where.startswith(str(venv)), where
    default = run([venv / "bin" / "pd2bw-train", "dry_run=true"], elsewhere).stdout
    assert "stage 1: layers" in default and "data: the embedded corpus" in default, default
    big = run([venv / "bin" / "pd2bw-train", "recipe=gpt13b", "dry_run=true"], elsewhere).stdout
    assert "stage 3: layers" in big, big


def test_gpu_check_fails_without_a_cuda_device():
    """``make gpu-check`` runs with a Python that already has torch (no install) and fails, not skips, without
    CUDA: a lent machine whose torch cannot see its GPU must not report success."""
    import shutil

    import torch

    if torch.cuda.is_available() or shutil.which("make") is None:
        pytest.skip("this check is for machines without CUDA (and with make)")
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        ["make", "-s", "gpu-check", f"GPU_PY={sys.executable}"], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0
    assert "NO CUDA DEVICE" in result.stdout and "needs a CUDA device" in result.stderr


def test_the_citation_names_the_package_version():
    """CITATION.cff's version is the package's (0.5.2 shipped a CITATION.cff that said 0.5.1)."""
    import re

    import lightning_pd2bw

    cited = re.search(r'^version: "([^"]+)"', (ROOT / "CITATION.cff").read_text(), re.M)
    assert cited and cited.group(1) == lightning_pd2bw.__version__
