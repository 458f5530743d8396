"""Test isolation for in-process Trainer runs: a test that fits with strategy='pd2bw' (or DDP) in the pytest process
leaves Lightning's default process group (its store still listening on MASTER_PORT) and the MASTER_* / rank variables
in os.environ; a later test's subprocesses would inherit the port and fail with EADDRINUSE."""

from __future__ import annotations

import importlib.util
import os
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


LONGEST_FIRST = (  # files measured longest (2026-11-24, serial seconds on 2 cores): started first, so that the last
    # file a worker takes is a short one (largest-first scheduling); then the other distributed files, then the unit
    "tests/distributed/test_equivalence.py",  # ~110 with test_nccl_traces and test_sparsity
    "tests/distributed/test_faults.py",  # ~110
    "tests/distributed/test_no_spikes.py",  # ~95
    "tests/distributed/test_preemption.py",  # ~65
    "tests/distributed/test_memory.py",  # ~60
    "tests/distributed/test_launchers.py",  # ~60
    "tests/unit/test_nccl_model.py",  # ~50
    "tests/distributed/test_examples.py",  # ~50
    "tests/distributed/test_hf_models.py",  # ~50
    "tests/distributed/test_reshard.py",  # ~45
    "tests/distributed/test_compile.py",  # ~40
    "tests/distributed/test_soak.py",  # ~40
)


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

    def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
        """Workers (``make test`` and ``make test-full`` run two): each takes whole ``scope_of`` units. (xdist's own
        ``--dist loadgroup`` does not group under pytest 9, which no longer reads ``item._nodeid``.)"""
        from xdist.scheduler import LoadScopeScheduling

        config.option.loadscopereorder = False  # keep the collection's order: LONGEST_FIRST (xdist's: most tests)

        class ByFile(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return scope_of(nodeid)

        return ByFile(config, log)
