"""Failure detection: no rank waits forever on a dead peer.

Every rank runs a watchdog thread with its own connection to the rendezvous store:

* heartbeat: it increments ``hb/<rank>`` every ``interval`` seconds;
* watch: it reads the counters of the ranks of its pipeline and of its stage's next replica (so
  every rank is watched by someone); a counter that has not moved for ``timeout`` seconds means
  that rank died (killed, its host lost, its interpreter wedged);
* verdict: the first rank to learn of a failure (its own exception, or a dead peer) writes one line
  to ``failed``; every watchdog polls that key and, once it is set, prints it and ends its process
  with exit code ``EXIT_CODE``: the main thread may be blocked inside a collective that would
  otherwise wait for the process-group timeout.

If the store itself stops answering, the process hosting it died (global rank 0, or torchrun's
agent). Ranks that leave cleanly mark themselves ``done`` and are no longer watched.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

EXIT_CODE = 75  # EX_TEMPFAIL: a peer failed; the job may be resumed from its last checkpoint
PREFIX = "pd2bw/watchdog/"


class Watchdog:
    """Heartbeats, watches peers and ends this process once any rank is known to have failed.

    Args:
        store: a store client of the job's rendezvous (``connect`` builds one from the environment).
        rank: this process's global rank.
        watched: the ranks this one watches.
        describe: ``rank -> "rank 3 (stage 1, replica 1)"`` for messages.
        timeout: seconds without a heartbeat after which a peer is declared dead.
        exit: how the process ends once a failure is known (tests may replace it).
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        watched: list[int],
        describe: Callable[[int], str],
        timeout: float,
        exit: Callable[[int], None] = os._exit,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"failure_timeout={timeout} must be > 0 seconds (or None to turn detection off)")
        self.store, self.rank, self.describe, self.timeout = store, rank, describe, timeout
        self.watched = sorted(set(watched) - {rank})
        self.interval = min(max(timeout / 6, 0.05), 5.0)
        self._exit = exit
        self._stop = threading.Event()
        self._ending = threading.Lock()
        self._thread: threading.Thread | None = None
        self._seen: dict[int, tuple[int, float]] = {}
        self.verdict: str | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.store.set(f"{PREFIX}info/{self.rank}", f"{socket.gethostname()} pid {os.getpid()}")
        self.store.set(f"{PREFIX}done/{self.rank}", "0")
        self._beat()
        now = time.monotonic()
        self._seen = {peer: (-1, now) for peer in self.watched}
        self._thread = threading.Thread(target=self._run, name="pd2bw-watchdog", daemon=True)
        self._thread.start()

    def stop(self, done: bool = True) -> None:
        """Stop watching; ``done`` tells the peers this rank left on purpose."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval * 4)
            self._thread = None
        if done:
            try:
                self.store.set(f"{PREFIX}done/{self.rank}", "1")
            except Exception:  # the store may be gone already; leaving is still fine
                pass

    # ------------------------------------------------------------------ reporting
    def report(self, reason: str) -> None:
        """Publish this rank's own failure (an exception it raised); the first report wins."""
        self._publish(f"{self.describe(self.rank)} failed: {reason}")

    def end_on_verdict(self, seconds: float) -> None:
        """Wait up to ``seconds`` for some rank's failure to be known, then end this process with it (a
        communication error in the main thread is usually a peer's death); returns if none is known."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.verdict is None:
            time.sleep(self.interval / 2)
        if self.verdict is not None:
            self._end(self.verdict)

    def _publish(self, message: str) -> None:
        try:
            if self.store.add(f"{PREFIX}failed", 1) == 1:  # the first verdict wins
                self.store.set(f"{PREFIX}verdict", message)
        except Exception:
            pass
        self.verdict = self.verdict or message

    # ------------------------------------------------------------------ the thread
    def _beat(self) -> None:
        self.store.add(f"{PREFIX}hb/{self.rank}", 1)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
                message = self._check()
            except Exception as error:  # the store is unreachable: its host died
                message = (
                    f"the rendezvous store ({os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')},"
                    f" hosted by {self.describe(0)} or the launcher) stopped answering ({type(error).__name__}: "
                    f"{error}); its process died"
                )
            if message is not None and not self._stop.is_set():
                self._end(message)
                return

    def _check(self) -> str | None:
        if self.store.add(f"{PREFIX}failed", 0) > 0:
            deadline = time.monotonic() + self.timeout
            while not self.store.check([f"{PREFIX}verdict"]) and time.monotonic() < deadline:
                time.sleep(0.01)
            return self.store.get(f"{PREFIX}verdict").decode()
        now = time.monotonic()
        for peer in self.watched:
            count = self.store.add(f"{PREFIX}hb/{peer}", 0)
            last, since = self._seen[peer]
            if count != last:
                self._seen[peer] = (count, now)
            elif now - since > self.timeout and self.store.add(f"{PREFIX}done/{peer}", 0) == 0:
                where = self._info(peer)
                message = (
                    f"{self.describe(peer)}{where} failed: killed or unresponsive (no heartbeat for "
                    f"{now - since:.1f} s; detected by rank {self.rank})"
                )
                self._publish(message)
                return self.verdict
        return None

    def _info(self, peer: int) -> str:
        key = f"{PREFIX}info/{peer}"
        return f" on {self.store.get(key).decode()}" if self.store.check([key]) else ""

    def _end(self, message: str) -> None:
        self.verdict = message
        if not self._ending.acquire(blocking=False):  # the other thread is ending the process already
            time.sleep(60)
            return
        print(
            f"\npd2bw: {message}. {self.describe(self.rank)} exits with code {EXIT_CODE}; resume from the last "
            "checkpoint (ckpt_path=...)",
            file=sys.stderr,
            flush=True,
        )
        if self.rank == 0:  # rank 0 may host the store: give the others time to read the verdict from it
            time.sleep(3 * self.interval + 0.5)
        self._exit(EXIT_CODE)


def connect(timeout: float) -> dist.Store:
    """A new client of the job's rendezvous store (MASTER_ADDR:MASTER_PORT), separate from the process group's."""
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return dist.distributed_c10d._get_default_store()  # e.g. init_method="file://...": share the group's
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    return dist.TCPStore(
        host, port, is_master=False, timeout=timedelta(seconds=max(timeout, 1.0)), wait_for_workers=False
    )


def is_peer_failure(error: BaseException) -> bool:
    """An error raised because a peer went away (a closed connection, a failed collective)."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(
        s in text for s in ("connection closed", "connection reset", "broken pipe", "gloo", "nccl", "timed out")
    )
