"""MkDocs hooks (``mkdocs.yml``): every page's footer names the package's version (read from
``lightning_pd2bw/__init__.py``, without importing it) and its license, and links the project page."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def version() -> str:
    return re.search(r'^__version__ = "([^"]+)"', (ROOT / "lightning_pd2bw" / "__init__.py").read_text(), re.M)[1]


def on_config(config, **kwargs):
    config["copyright"] = (
        f"lightning_pd2bw {version()} &middot; Apache-2.0 &middot; "
        '<a href="/project/">changelog, license and citation</a>'
    )
    return config
