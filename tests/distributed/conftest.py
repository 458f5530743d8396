from __future__ import annotations

import pytest

from .cases import CASES
from .launch import torchrun

TWO = [n for n, c in CASES.items() if "d4" not in n and "w2" not in n]
FOUR = [n for n in CASES if "d4" in n or "w2" in n]


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> dict:
    """Run every case once (two torchrun jobs) and hand out the output folders."""
    root = tmp_path_factory.mktemp("cases")
    torchrun(root, 2, TWO)
    torchrun(root, 4, FOUR)
    return {name: root / name for name in CASES}
