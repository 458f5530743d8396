"""``pd2bw-train`` as the tests start it: in this process by default (a check of the CLI's parsing, composition,
checks and dry run costs 0.1-1 s instead of a 6 s interpreter start), or as a process."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path


def run_cli(*args: str, cwd: Path, in_process: bool = True) -> subprocess.CompletedProcess:
    """``pd2bw-train ARGS`` in ``cwd``: by default in this process (its ``main``, as the console script calls it:
    Hydra's own argument parsing and composition, 0.1-1 s instead of a 6 s interpreter start), or as a process."""
    if not in_process:
        command = [sys.executable, "-m", "lightning_pd2bw.cli.train", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=cwd)
    from hydra.core.global_hydra import GlobalHydra

    from lightning_pd2bw.cli.train import main

    out, err, code, argv, here = io.StringIO(), io.StringIO(), 0, sys.argv, Path.cwd()
    try:
        os.chdir(cwd)
        sys.argv = ["pd2bw-train", *args]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else 1
                if isinstance(exit_.code, str):
                    err.write(exit_.code + "\n")  # what the interpreter prints for SystemExit("message")
    finally:
        sys.argv = argv
        os.chdir(here)
        GlobalHydra.instance().clear()
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())
