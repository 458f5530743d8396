"""Every figure the docs and the README quote about a recipe is what the recipes' dry runs print now
(``docs/_ext/recipe_figures.py``: one source; a figure that moves in the code moves in the docs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.full
def test_the_generated_recipe_figures_are_the_dry_runs():
    done = subprocess.run(
        [sys.executable, "docs/_ext/recipe_figures.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_page_types_the_recipes_figures_again():
    """The generated figures appear in the docs only through the generated snippets (a typed copy goes stale)."""
    typed = []
    generated = (ROOT / "docs" / "_generated" / "recipe-gpt13b-modes.md").read_text()
    step = generated.split("| planned step, rate | ")[1].split(" s,")[0]  # the recipe's planned step, e.g. 6.28
    for page in [*(ROOT / "docs").glob("*.md"), *(ROOT / "recipes").glob("*.yaml")]:
        if f"planned step {step} s" in page.read_text() or f"at the planned {step} s" in page.read_text():
            typed.append(page.name)
    assert not typed, f"{typed} type the recipe's planned step; include docs/_generated/recipe-*.md instead"
