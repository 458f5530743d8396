from __future__ import annotations

import pytest

from .cases import CASES
from .launch import torchrun

WORLDS = sorted({case.world for case in CASES.values()})  # each case declares its layout (num_stages x width)


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> dict:
    """Run every case once (one torchrun job per world size) and hand out the output folders."""
    root = tmp_path_factory.mktemp("cases")
    for world in WORLDS:
        torchrun(root, world, [name for name, case in CASES.items() if case.world == world])
    return {name: root / name for name in CASES}
