"""The one way distributed tests start processes: ``torchrun_script`` (torchrun, as users launch), ``torchrun``
(the equality cases' runner) and ``launch_ranks`` (each rank its own process, for fault injection)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

RUNNER = Path(__file__).with_name("run_cases.py")
ROOT = Path(__file__).resolve().parents[2]


def torchrun(out: Path, world: int, cases: list[str], timeout: float = 600) -> None:
    torchrun_script(RUNNER, [str(out), *cases], world, timeout)


def torchrun_script(
    script: Path,
    args: list[str],
    world: int,
    timeout: float = 600,
    options: tuple[str, ...] = (),
    check: bool = True,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node=WORLD [options] SCRIPT ARGS`` with one thread per rank and this
    repository importable; fails with the output's tail unless ``check=False``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **(env or {}))
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={world}",
        "--standalone",
        *options,
        str(script),
        *args,
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if check and result.returncode != 0:
        raise AssertionError(
            f"torchrun failed ({result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
        )
    return result


FAULT = "[test] fault at "  # + time.time(), on a rank's stderr when a test injects its fault (a SIGTERM, a kill, ...)


def mark_fault() -> None:
    """Print the wall-clock time of the fault about to be injected: tests bound the time from it to the last exit."""
    print(f"{FAULT}{time.time():.3f}", file=sys.stderr, flush=True)


@dataclass
class RankResult:
    rank: int
    returncode: int
    stderr: str
    ended: float  # time.time() when its exit was seen (at or after the exit: the ranks are awaited in turn)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(
    script: Path, args: list[str], world: int, timeout: float = 240, frozen: int | None = None
) -> list[RankResult]:
    """Start ``world`` processes as a cluster scheduler does (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_*), with no
    agent watching them; wait for all (killing any still alive after ``timeout``). Rank ``frozen`` stops itself
    (SIGSTOP) and never exits: it is killed once every other rank has exited."""
    port = free_port()
    procs = []
    start = time.monotonic()
    for rank in range(world):
        env = dict(
            os.environ,
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(ROOT),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            WORLD_SIZE=str(world),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            NODE_RANK="0",
        )
        procs.append(
            subprocess.Popen([sys.executable, str(script), *args], env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
        )
    results = []
    order = [r for r in range(world) if r != frozen] + ([frozen] if frozen is not None else [])
    for rank in order:
        proc = procs[rank]
        if rank == frozen:
            proc.kill()
        try:
            _, err = proc.communicate(timeout=max(timeout - (time.monotonic() - start), 1))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            _, err = proc.communicate()
            err += f"\n[test] rank {rank} still running after {timeout} s: killed"
        results.append(RankResult(rank, proc.returncode, err, time.time()))
    return sorted(results, key=lambda r: r.rank)


def seconds_from_fault(results: list[RankResult], frozen: int | None = None) -> float:
    """From the first fault marked on any rank's stderr (``mark_fault``) to the last exit of a rank other than
    ``frozen`` (which never exits by itself). Start-up is left out: on a loaded machine (ranks beside other tests
    on 2 cores) it is not the time the fault's handling takes."""
    marks = [
        float(line.removeprefix(FAULT)) for r in results for line in r.stderr.splitlines() if line.startswith(FAULT)
    ]
    assert marks, "no rank marked its fault: it was never injected"
    return max(r.ended for r in results if r.rank != frozen) - min(marks)
