"""Test isolation for in-process Trainer runs: a test that fits with strategy='pd2bw' (or DDP) in the pytest process
leaves Lightning's default process group (its store still listening on MASTER_PORT) and the MASTER_* / rank variables
in os.environ; a later test's subprocesses would inherit the port and fail with EADDRINUSE."""

from __future__ import annotations

import os

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
    deselects ``full``, ``make test-full`` (CI) runs everything but ``slow``.

    Workers (pytest-xdist, ``-n 2 --dist loadgroup`` in both tiers): a file's tests are one group, run by one worker
    (spreading one file's distributed tests over both workers was slower on 2 cores: their processes contend),
    and tests that share a module- or session-scoped fixture of ours (the equivalence runs, which
    ``test_nccl_traces.py`` also reads) join that fixture's group, so it runs once."""
    for item in items:
        if "distributed" in item.path.parts and item.get_closest_marker("smoke") is None:
            item.add_marker(pytest.mark.full)
        shared = shared_fixtures(item)
        item.add_marker(pytest.mark.xdist_group(shared[0] if shared else item.path.name))


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
