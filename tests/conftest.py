"""Test isolation for in-process Trainer runs: a test that fits with strategy='pd2bw' (or DDP) in the pytest process
leaves Lightning's default process group (its store still listening on MASTER_PORT) and the MASTER_* / rank variables
in os.environ; a later test's subprocesses would inherit the port and fail with EADDRINUSE."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import time
from datetime import date
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def no_process_group_or_environment_leaks():
    saved = dict(os.environ)
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tiers: every test under tests/distributed (real processes) is ``full`` unless marked ``smoke``; ``make test``
    deselects ``full``, ``make test-full`` (CI) runs everything but ``slow``. Also checks that the tests sharing a
    module- or session-scoped fixture of ours are in one ``scope_of`` (one xdist worker runs the fixture once)."""
    users: dict[str, set[str]] = {}
    for item in items:
        if "distributed" in item.path.parts and item.get_closest_marker("smoke") is None:
            item.add_marker(pytest.mark.full)
        for fixture in shared_fixtures(item):
            users.setdefault(fixture, set()).add(scope_of(item.nodeid))
    split = {fixture: sorted(scopes) for fixture, scopes in users.items() if len(scopes) > 1}
    if split:
        raise pytest.UsageError(f"fixtures used from several xdist scopes (add them to SAME_WORKER): {split}")
    items.sort(key=lambda item: start_order(scope_of(item.nodeid)))  # stable: a file's tests keep their order


DURATIONS = Path(__file__).with_name("durations.json")  # what `make test-full` (CI's `.ci/run`) measured last


def recorded_durations() -> dict[str, Any]:
    """The last record ``make test`` / ``make test-full`` wrote (``PD2BW_DURATIONS=<tier>``): per tier its wall
    time, the tests passed, the date, and each file's serial seconds (setup, call and teardown of its tests)."""
    return json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}


def longest_first(count: int = 12) -> tuple[str, ...]:
    """The files the full tier measured longest: started first, so that the last file a worker takes is a short one
    (largest-first scheduling); then the other distributed files, then the unit tests. Read from the record, not
    typed (issue 61)."""
    files = recorded_durations().get("full", {}).get("files", {})
    return tuple(sorted(files, key=lambda name: -files[name])[:count])


LONGEST_FIRST = longest_first()


def start_order(scope: str) -> tuple[int, int]:
    if scope in LONGEST_FIRST:
        return (0, LONGEST_FIRST.index(scope))
    return (1 if "/distributed/" in scope else 2, 0)


SAME_WORKER = {  # test files that read another file's session fixture run on that file's worker
    "tests/distributed/test_nccl_traces.py": "tests/distributed/test_equivalence.py",  # the equivalence runs
    "tests/distributed/test_sparsity.py": "tests/distributed/test_equivalence.py",
}


def scope_of(nodeid: str) -> str:
    """The unit of work an xdist worker takes whole: a test file (spreading one file's distributed tests over both
    workers was slower on 2 cores: their processes contend, and its module fixtures ran once per worker)."""
    path = nodeid.split("::", 1)[0]
    return SAME_WORKER.get(path, path)


def shared_fixtures(item: pytest.Item) -> list[str]:
    """The module- or session-scoped fixtures of this repository ``item`` uses (pytest's own have no base id)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    return sorted(
        f"{defs[-1].baseid}::{name}"
        for name, defs in info.name2fixturedefs.items()
        if defs and defs[-1].scope in ("module", "package", "session") and defs[-1].baseid
    )


if importlib.util.find_spec("xdist") is not None:

    @pytest.hookimpl(optionalhook=True)  # xdist installed but not loaded (PYTEST_DISABLE_PLUGIN_AUTOLOAD: gpu_first.py)
    def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
        """Workers (``make test`` and ``make test-full`` run two): each takes whole ``scope_of`` units. (xdist's own
        ``--dist loadgroup`` does not group under pytest 9, which no longer reads ``item._nodeid``.)"""
        from xdist.scheduler import LoadScopeScheduling

        config.option.loadscopereorder = False  # keep the collection's order: LONGEST_FIRST (xdist's: most tests)

        class ByFile(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return scope_of(nodeid)

        return ByFile(config, log)


README = Path(__file__).parents[1] / "README.md"
TIER_ROWS = {"fast": "| `make test` |", "full": "| `make test-full` |"}


def readme_with_times(text: str, record: dict[str, Any]) -> str:
    """The README with each tier's row giving the record's pytest time, tests passed and date."""
    lines = text.splitlines(keepends=True)
    for tier, start in TIER_ROWS.items():
        entry = record.get(tier)
        if entry is None:
            continue
        for index, line in enumerate(lines):
            if line.startswith(start):
                times = f"pytest {round(entry['wall_s'])} s, {entry['passed']} passed; {entry['date']}"
                line = re.sub(r"pytest \d+ s, \d+ passed; \d{4}-\d\d-\d\d", times, line)
                lines[index] = re.sub(r"~\d+ min", f"~{max(1, round(entry['wall_s'] / 60))} min", line)
    return "".join(lines)


class DurationRecord:
    """Writes ``tests/durations.json``'s entry for one tier (``PD2BW_DURATIONS=fast|full``, set by the Makefile):
    on the controller, from every test's report (xdist's workers send theirs there); and the README's test times
    from it (``readme_with_times``)."""

    def __init__(self, tier: str) -> None:
        self.tier, self.started = tier, time.monotonic()
        self.files: dict[str, float] = {}
        self.passed = 0

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        path = report.nodeid.split("::", 1)[0]
        self.files[path] = self.files.get(path, 0.0) + report.duration
        self.passed += report.when == "call" and report.passed

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if exitstatus != 0 or hasattr(session.config, "workerinput"):  # a failed run or an xdist worker: no record
            return
        record = recorded_durations()
        record[self.tier] = {
            "date": date.today().isoformat(),
            "wall_s": round(time.monotonic() - self.started, 1),
            "passed": self.passed,
            "files": {name: round(seconds, 1) for name, seconds in sorted(self.files.items())},
        }
        DURATIONS.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        README.write_text(readme_with_times(README.read_text(), record))


def pytest_configure(config: pytest.Config) -> None:
    tier = os.environ.get("PD2BW_DURATIONS")
    if tier and not hasattr(config, "workerinput"):
        config.pluginmanager.register(DurationRecord(tier), "pd2bw-durations")
