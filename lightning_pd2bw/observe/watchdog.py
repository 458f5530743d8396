"""Failure detection: no rank waits forever on a dead, failed or stuck peer.

Every rank runs a watchdog thread with its own connection to the rendezvous store:

* heartbeat: it increments ``hb/<rank>`` every ``interval`` seconds and publishes the rank's progress
  (``state/<rank>``: actions executed so far and the current one, ticked by the main thread);
* watch: it reads the counters of the ranks of its pipeline and of its stage's next replica (so
  every rank is watched by someone); a heartbeat that has not moved for ``timeout`` seconds means
  that rank died (killed, its host lost, its interpreter wedged);
* progress: once armed (training started), if neither this rank nor any rank it watches has made
  progress for ``hang_timeout`` seconds, the pipeline is stuck (a receive that never comes, a
  mismatched collective, a transport deadlock) while every heartbeat still beats;
* verdict: the first rank to learn of a failure (its own exception, a dead peer, a hang) writes one
  line to ``verdict``; every watchdog polls that key and, once it is set, acknowledges it, writes it
  with its own current action and Python stack (``faulthandler``) and ends its process with exit code
  ``EXIT_CODE`` (``REFUSED_CODE`` where the failure is a rank's ``Refusal``: a resume would meet it again): the
  main thread may be blocked inside a collective that would otherwise wait for the process-group timeout.
  Where the run has a log file (``pd2bw-train``: Hydra's, one per rank), the stacks go there and only one rank
  speaks on the terminal: global rank 0, or every survivor where rank 0 or its store is gone; the verdict is its
  last line. Without one, every rank writes everything to its stderr.

Before a rank exits with a verdict it waits (bounded) until every other rank has acknowledged it (after
printing its own stack), left, or is known dead: global rank 0 usually hosts the store (Lightning's launcher,
a scheduler's ``RANK``/``MASTER_*``), so no survivor mistakes the store's disappearance for the cause, and no
survivor's stack is disturbed by a peer's exit before it is printed. Keys are scoped to the restart
attempt (``TORCHELASTIC_RESTART_COUNT``): torchrun's agent keeps its store across ``--max-restarts``, and a
restarted job must not read the previous attempt's verdict. Ranks that leave cleanly mark themselves
``done`` and are no longer watched.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from ..engine.observer import Progress
from .flight_recorder import abort_nccl

# Progress (engine.observer) is the main thread's side of the watchdog; re-exported here for its users

EXIT_CODE = 75  # EX_TEMPFAIL: the job ended early and may be resumed from its last checkpoint
REFUSED_CODE = 1  # a rank refused (``errors.Refusal``): resuming would meet the same refusal
PREFIX = "pd2bw/watchdog/"


def restart_attempt() -> int:
    """torchrun's restart counter (0 outside torchrun or on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


class Watchdog:
    """Heartbeats, watches peers and ends this process once any rank is known to have failed.

    Args:
        store: a store client of the job's rendezvous (``connect`` builds one from the environment).
        rank: this process's global rank.
        world_size: the number of ranks.
        watched: the ranks this one watches.
        describe: ``rank -> "rank 3 (stage 1, replica 1)"`` for messages.
        timeout: seconds without a heartbeat after which a peer is declared dead.
        hang_timeout: seconds without progress of this rank and the ranks it watches after which the job is
            declared stuck (None: not checked); only while ``arm``-ed.
        progress: the main thread's ``Progress``.
        exit: how the process ends once a failure is known (tests may replace it).
        log_file: where this rank's stacks go on a verdict (None: stderr; ``log_file()`` finds the run's).
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        watched: list[int],
        describe: Callable[[int], str],
        timeout: float,
        hang_timeout: float | None = None,
        progress: Progress | None = None,
        exit: Callable[[int], None] = os._exit,
        log_file: str | None = None,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"failure_timeout={timeout} must be > 0 seconds (or None to turn detection off)")
        if hang_timeout is not None and hang_timeout <= 0:
            raise ValueError(f"hang_timeout={hang_timeout} must be > 0 seconds (or None to turn it off)")
        self.store, self.rank, self.world_size, self.describe = store, rank, world_size, describe
        self.timeout, self.hang_timeout = timeout, hang_timeout
        self.progress = progress or Progress()
        self.prefix = f"{PREFIX}attempt{restart_attempt()}/"
        self.watched = sorted(set(watched) - {rank})
        self.interval = min(max(timeout / 6, 0.05), 5.0)
        if hang_timeout is not None:
            self.interval = min(self.interval, max(hang_timeout / 6, 0.05))
        self._exit, self.log_file = exit, log_file
        self._store_lost = False
        self._stop = threading.Event()
        self._ending = threading.Lock()
        self._thread: threading.Thread | None = None
        self._seen: dict[int, tuple[int, float]] = {}
        self._published_state: str | None = None
        self._armed_at: float | None = None
        self._last_progress: tuple[tuple[int, ...], float] | None = None
        self.verdict: str | None = None

    def _key(self, name: str) -> str:
        return self.prefix + name

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.store.set(self._key(f"info/{self.rank}"), f"{socket.gethostname()} pid {os.getpid()}")
        self.store.set(self._key(f"done/{self.rank}"), "0")
        self._beat()
        now = time.monotonic()
        self._seen = {peer: (-1, now) for peer in self.watched}
        self._thread = threading.Thread(target=self._run, name="pd2bw-watchdog", daemon=True)
        self._thread.start()

    def arm(self) -> None:
        """Start checking progress (training began)."""
        self._last_progress = None
        self._armed_at = time.monotonic()

    def disarm(self) -> None:
        """Stop checking progress (training ended: what follows may take any time)."""
        self._armed_at = None

    def stop(self, done: bool = True) -> None:
        """Stop watching; ``done`` tells the peers this rank left on purpose."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval * 4)
            self._thread = None
        if done:
            try:
                self.store.set(self._key(f"done/{self.rank}"), "1")
            except Exception:  # the store may be gone already; leaving is still fine
                pass

    # ------------------------------------------------------------------ reporting
    def report(self, reason: str, refused: bool = False) -> None:
        """Publish this rank's own failure (an exception it raised; ``refused``: a ``Refusal``, whose message is
        the whole story); the first report wins."""
        verb = "refused" if refused else "failed"
        self._publish(f"{self.describe(self.rank)} {verb}: {reason}", refused)
        self._acknowledge()

    @property
    def speaks(self) -> bool:
        """Whether this rank writes the verdict on the terminal: every rank without a log file; with one, global
        rank 0, or every survivor once rank 0 or the store it hosts is gone (rank 0's own error is its to say)."""
        if self.log_file is None or self.rank == 0 or self._store_lost:
            return True
        try:
            return self.store.check([self._key("dead/0")])
        except Exception:  # the store is gone with rank 0
            return True

    def end_on_verdict(self, seconds: float) -> None:
        """Wait up to ``seconds`` for some rank's failure to be known, then end this process with it (a
        communication error in the main thread is usually a peer's death); returns if none is known."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.verdict is None:
            time.sleep(self.interval / 2)
        if self.verdict is not None:
            self._end(self.verdict)

    def linger(self) -> None:
        """Wait until every other rank has acknowledged the verdict (after printing its stack), left, or is known
        dead (bounded): global rank 0 may host the store, which dies with it, and a rank that exits breaks its
        peers' connections, which would move their main threads before their stacks are printed."""
        deadline = time.monotonic() + min(self.timeout + 2 * self.interval, 60.0)
        pending = [r for r in range(self.world_size) if r != self.rank]
        while pending and time.monotonic() < deadline:
            try:
                pending = [r for r in pending if not self._has_left(r)]
            except Exception:  # the store is gone: nobody can read it any more
                return
            time.sleep(0.05)

    def _has_left(self, rank: int) -> bool:
        keys = [self._key(f"{name}/{rank}") for name in ("seen", "dead")]
        if any(self.store.check([key]) for key in keys):
            return True
        done = self._key(f"done/{rank}")
        return self.store.check([done]) and self.store.get(done) == b"1"

    def _publish(self, message: str, refused: bool = False) -> None:
        try:
            if self.store.add(self._key("failed"), 1) == 1:  # the first verdict wins
                if refused:
                    self.store.set(self._key("refused"), "1")
                self.store.set(self._key("verdict"), message)
        except Exception:
            pass
        self.verdict = self.verdict or message

    def _acknowledge(self) -> None:
        try:
            self.store.set(self._key(f"seen/{self.rank}"), "1")
        except Exception:  # the store is gone: nobody waits for this any more
            pass

    # ------------------------------------------------------------------ the thread
    def _beat(self) -> None:
        self.store.add(self._key(f"hb/{self.rank}"), 1)
        state = f"{self.progress.count} {self.progress.where}"
        if state != self._published_state:
            self.store.set(self._key(f"state/{self.rank}"), state)
            self._published_state = state

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
                message = self._check()
            except Exception as error:  # the store is unreachable: its host died
                self._store_lost = True
                message = (
                    f"the rendezvous store ({os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')},"
                    f" hosted by {self.describe(0)} or the launcher) stopped answering ({type(error).__name__}: "
                    f"{error}); its process died"
                )
            if message is not None and not self._stop.is_set():
                self._end(message)
                return

    def _check(self) -> str | None:
        if self.store.add(self._key("failed"), 0) > 0:
            deadline = time.monotonic() + self.timeout
            while not self.store.check([self._key("verdict")]) and time.monotonic() < deadline:
                time.sleep(0.01)
            return self.store.get(self._key("verdict")).decode()
        now = time.monotonic()
        for peer in self.watched:
            count = self.store.add(self._key(f"hb/{peer}"), 0)
            last, since = self._seen[peer]
            if count != last:
                self._seen[peer] = (count, now)
            elif now - since > self.timeout and self.store.add(self._key(f"done/{peer}"), 0) == 0:
                self.store.set(self._key(f"dead/{peer}"), "1")
                message = (
                    f"{self.describe(peer)}{self._info(peer)} failed: killed or unresponsive (no heartbeat for "
                    f"{now - since:.1f} s; detected by rank {self.rank})"
                )
                self._publish(message)
                return self.verdict
        return self._check_progress(now)

    def _check_progress(self, now: float) -> str | None:
        if self.hang_timeout is None or self._armed_at is None:
            return None
        counts = (self.progress.count, *(self._state(peer)[0] for peer in self.watched))
        if self._last_progress is None or self._last_progress[0] != counts:
            self._last_progress = (counts, now)
            return None
        stalled = now - max(self._last_progress[1], self._armed_at)
        if stalled <= self.hang_timeout:
            return None
        where = "; ".join(f"{self.describe(r)}: {self._state(r)[1]}" for r in range(self.world_size))
        self._publish(
            f"no progress for {stalled:.1f} s (hang_timeout={self.hang_timeout:g} s; detected by rank {self.rank}: "
            f"neither it nor the ranks it watches executed an action). Each rank was at: {where}"
        )
        return self.verdict

    def _state(self, rank: int) -> tuple[int, str]:
        key = self._key(f"state/{rank}")
        if not self.store.check([key]):
            return -1, "not started"
        count, _, where = self.store.get(key).decode().partition(" ")
        return int(count), f"{where} (action #{count})"

    def _info(self, peer: int) -> str:
        key = self._key(f"info/{peer}")
        return f" on {self.store.get(key).decode()}" if self.store.check([key]) else ""

    def _end(self, message: str) -> None:
        self.verdict = message
        if not self._ending.acquire(blocking=False):  # the other thread is ending the process already
            time.sleep(60)
            return
        code = REFUSED_CODE if self._refused() else EXIT_CODE
        then = (
            "the refusal names the fix" if code == REFUSED_CODE else "resume from the last checkpoint (ckpt_path=...)"
        )
        text = f"pd2bw: {message}. {self.describe(self.rank)} exits with code {code}; {then}."
        where = f"This rank was at: {self.progress.where} (action #{self.progress.count}); its Python stacks:"
        log = _open_for_append(self.log_file)
        stacks = log or sys.stderr
        print(f"\n{text} {where}", file=stacks, flush=True)
        try:
            faulthandler.dump_traceback(file=stacks, all_threads=True)
        except (AttributeError, ValueError, OSError):  # stderr is not a file (captured)
            pass
        stacks.flush()
        if log is not None:
            log.close()
            if self.speaks:  # the one message, last on the terminal; every rank's stacks in its log
                print(f"\n{text} Its stacks: {self.log_file}", file=sys.stderr, flush=True)
        self._acknowledge()
        self.linger()
        dump = abort_nccl(self.rank)
        if dump is not None:
            print(f"pd2bw: NCCL's flight recorder for this rank: {dump}", file=sys.stderr, flush=True)
        self._exit(code)

    def _refused(self) -> bool:
        try:
            return self.store.check([self._key("refused")])
        except Exception:  # the store is gone: not a refusal anyone could publish
            return False


def _open_for_append(path: str | None):  # noqa: ANN202 - a text file or None
    try:
        return open(path, "a") if path is not None else None  # noqa: SIM115 - faulthandler writes to its descriptor
    except OSError:
        return None


def log_file() -> str | None:
    """The run's log file where it has one (``pd2bw-train``: Hydra's file handler on the root logger), else None."""
    import logging

    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    return files[0].baseFilename if files else None


def connect(timeout: float) -> dist.Store:
    """A new client of the job's rendezvous store (MASTER_ADDR:MASTER_PORT), separate from the process group's."""
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return dist.distributed_c10d._get_default_store()  # e.g. init_method="file://...": share the group's
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return dist.TCPStore(
        host, port, is_master=False, timeout=timedelta(seconds=max(timeout, 1.0)), wait_for_workers=False
    )


def attempt_scoped_store(timeout: timedelta) -> dist.Store | None:
    """Under torchrun's agent store, a store for the default process group scoped to the restart attempt.

    torchrun (torch 2.13, ``--standalone`` or c10d rendezvous) keeps one store server, on the same port, across
    ``--max-restarts``, and ``env://`` initialisation adds no per-attempt prefix: a restarted worker can read the
    previous attempt's addresses (gloo: "connection refused" to a dead rank; NCCL: a stale unique id, a hang),
    depending on which rank writes first. Measured here with a plain gloo ``init_process_group`` + all-reduce:
    the restarted attempt fails or succeeds by timing. Returns None outside torchrun's agent store.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    client = dist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
    return dist.PrefixStore(f"pd2bw/attempt{restart_attempt()}/", client)


def is_peer_failure(error: BaseException) -> bool:
    """An error raised because a peer went away (a closed connection, a failed collective)."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(
        s in text for s in ("connection closed", "connection reset", "broken pipe", "gloo", "nccl", "timed out")
    )
