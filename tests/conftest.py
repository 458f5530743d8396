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
    deselects ``full``, ``make test-full`` (CI) runs everything but ``slow``."""
    for item in items:
        if "distributed" in item.path.parts and item.get_closest_marker("smoke") is None:
            item.add_marker(pytest.mark.full)
