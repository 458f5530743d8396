"""The run's folder: its name (the same on every rank and across restarts), one run per folder, every rank in rank
0's folder, and ``ckpt_path=last`` resolved in it (``pd2bw-train``'s, ``cli/train.py``)."""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
from pathlib import Path


def say(text: str) -> None:
    """What the run tells its user: on stdout, and in the run's log (``train.log``: Hydra's job logging)."""
    print(text, flush=True)
    logging.getLogger("lightning_pd2bw.run").info(text)


def run_name() -> str:
    """The run's directory name: the same on every rank of a job and across its restarts, different for two jobs.

    ``PD2BW_RUN_ID`` (set it to share a directory on purpose) > torchrun's ``--rdzv-id`` (``--standalone``
    draws a fresh one) > ``SLURM_JOB_ID`` > the start time and pid of the process that started the ranks: under
    torchrun without ``--rdzv-id`` (its run id is then ``"none"`` for every job) the agent, which every local
    worker shares and which outlives restarts; otherwise this process (Lightning's launcher passes rank 0's
    directory to the ranks it starts).
    """
    if os.environ.get("PD2BW_RUN_ID"):
        return os.environ["PD2BW_RUN_ID"]
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return run_id
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm-{os.environ['SLURM_JOB_ID']}"
    pid = os.getppid() if run_id == "none" else os.getpid()
    return f"{_start_time(pid):%Y-%m-%d_%H-%M-%S}-{pid}"


def _start_time(pid: int) -> datetime.datetime:
    """When process ``pid`` started (Linux ``/proc``; elsewhere: now)."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
        )
        return datetime.datetime.fromtimestamp(boot + ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, StopIteration):
        return datetime.datetime.now()


def resolve_last_checkpoint(cfg) -> None:
    """``ckpt_path=last``: the newest complete checkpoint the run's checkpoint callback wrote (a run restarted by
    ``torchrun --max-restarts`` or requeued by SLURM resumes from it: its ranks and restarts share the run
    directory), or a fresh start when there is none and the run is new. Never a fresh start in silence: a run that
    was started before (a restart count above 0, or its ``config.yaml`` in the output folder: a resubmission naming
    the same run, older than this process) with no complete checkpoint is refused naming the folder searched, and every save passed over
    for want of a manifest is named."""
    from omegaconf import open_dict

    from ..checkpoint.finding import incomplete_checkpoints, newest_checkpoint
    from ..lightning.slurm import restart_count
    from .checks import ConfigError

    if cfg.get("ckpt_path") != "last":
        return
    if (chosen := _parents_choice(cfg)) is not None:
        with open_dict(cfg):
            cfg.ckpt_path = chosen or None
        return
    node = (cfg.get("callbacks") or {}).get("model_checkpoint")
    directory = Path(node.dirpath) if node and node.get("dirpath") else Path(cfg.paths.output_dir) / "checkpoints"
    found = newest_checkpoint(directory)
    for skipped in incomplete_checkpoints(directory):
        why = "a save that did not finish" if skipped.name.endswith(".tmp") else "its manifest.json is gone"
        say(f"ckpt_path=last: passed over {skipped} ({why}: not a complete checkpoint)")
    if found is None:
        restarts, config = restart_count(), Path(cfg.paths.output_dir) / "config.yaml"
        # written by an earlier job: older than this process (this job's rank 0 writes it after every rank started,
        # or before Lightning's launcher starts the others)
        earlier = config.is_file() and config.stat().st_mtime < _start_time(os.getpid()).timestamp()
        if restarts or earlier:
            before = f"restart {restarts} of this job" if restarts else f"{config} is there from an earlier start"
            raise ConfigError(
                f"ckpt_path=last: no complete checkpoint in {directory}, but this run was started before ({before}); "
                "starting over would lose its work in silence. Point paths.output_dir (or "
                "callbacks.model_checkpoint.dirpath) at the folder that holds its checkpoints, or start over on "
                "purpose with ckpt_path=null"
            )
    say(f"ckpt_path=last: {f'resuming from {found}' if found else f'no checkpoint in {directory} yet, starting'}")
    os.environ[CHOSEN] = json.dumps({"pid": os.getpid(), "dir": str(cfg.paths.output_dir), "ckpt": str(found or "")})
    with open_dict(cfg):
        cfg.ckpt_path = str(found) if found else None


CHOSEN = "PD2BW_CKPT_LAST"  # the job's first process's choice, which the ranks Lightning's launcher starts inherit


def _parents_choice(cfg) -> str | None:
    """In a rank Lightning's launcher started, the checkpoint its parent (the job's first process) chose ("": none):
    the parent writes ``config.yaml`` before it starts the ranks, which would otherwise read as an earlier start's.
    None where this process must choose (no such parent: torchrun's and SLURM's ranks, a restart, another run)."""
    try:
        choice = json.loads(os.environ.get(CHOSEN, ""))
    except ValueError:
        return None
    if choice.get("pid") != os.getppid() or choice.get("dir") != str(cfg.paths.output_dir):
        return None
    return choice.get("ckpt", "")


RUN_LOCK = ".pd2bw-run.json"


def claim_output_dir(out: Path) -> None:
    """One run per output folder: the job's first process writes ``RUN_LOCK`` (host, pid) and removes it at exit. A
    second run started into a folder whose owner is alive on this host is refused before any process starts (two
    runs would share ``summary.json``, ``config.yaml``, ``train.log`` and the checkpoints, and a save replaces the
    other's half-written one). A restarted job (its old owner gone) or the ranks of the same job proceed."""
    import atexit

    from .checks import ConfigError

    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))  # torchrun's, else srun's task
    local = os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    if rank != "0" or local != "0":
        return  # the job's other processes (Lightning's launcher starts them with LOCAL_RANK set; srun's tasks)
    lock = out / RUN_LOCK
    host, pid = socket.gethostname(), os.getpid()
    if lock.is_file():
        try:
            owner = json.loads(lock.read_text())
        except (OSError, ValueError):
            owner = {}
        if owner.get("host") == host and owner.get("pid") != pid and _alive(int(owner.get("pid", 0))):
            raise ConfigError(
                f"{out} is the output folder of a run still going (pid {owner['pid']} on {host}): two runs in one "
                "folder overwrite each other's summary, log and checkpoints. Give this run its own "
                "paths.output_dir (the default names a fresh one per job), or stop the other"
            )
        if owner.get("host") not in (None, host):
            say(f"pd2bw-train: {out} was claimed by a run on {owner['host']} (pid {owner.get('pid')}); taking it over")
    out.mkdir(parents=True, exist_ok=True)
    lock.write_text(json.dumps({"host": host, "pid": pid}))

    def release() -> None:
        try:
            if json.loads(lock.read_text()).get("pid") == pid:
                lock.unlink()
        except (OSError, ValueError):
            pass

    atexit.register(release)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pin_output_dir(cfg) -> None:
    """All ranks write to rank 0's directory: Lightning's launcher passes it to the others as
    ``hydra.run.dir`` (``paths.output_dir`` may hold ``${now:...}``, which differs per process)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    if HydraConfig.initialized():
        with open_dict(cfg):
            cfg.paths.output_dir = HydraConfig.get().runtime.output_dir
