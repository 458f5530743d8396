"""Markdown faults the strict MkDocs build does not catch (``make docs`` runs this first; ``tests/unit/test_docs.py``).

- A list right after a paragraph line, without a blank line between: Python-Markdown then renders the items as
  run-on text of the paragraph.
- A code line longer than ``CODE_WIDTH`` characters: the site shows about that many before clipping at the right
  edge (Material's content column at a laptop's width).
- A page longer than about a screen (``SCREEN_WORDS``) without ``##`` subheadings: no table of contents to
  find one's way with.

    python docs/_ext/lint.py            # every page of docs/; exit 1 listing each fault as file:line: what
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

CODE_WIDTH = 120
SCREEN_WORDS = 400
ITEM = re.compile(r"^\s*(?:[-*+]|\d+\.)\s+\S")


def faults(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    found, fenced, previous, in_list = [], False, "", False
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fenced, previous = not fenced, ""
            continue
        if fenced:
            if len(line) > CODE_WIDTH:
                found.append(f"{path}:{number}: code line of {len(line)} characters (> {CODE_WIDTH}): it is clipped")
            continue
        if ITEM.match(line):
            if previous and not in_list and not previous.lstrip().startswith(("#", "|", ">", "<")):
                found.append(f"{path}:{number}: a list right after a paragraph line: put a blank line before it")
            in_list = True
        elif line.strip() and not previous and _indent(line) == 0:
            in_list = False  # a paragraph after a blank line: the list (if any) has ended
        previous = line if line.strip() else ""
    words = sum(len(line.split()) for line in lines)
    if words > SCREEN_WORDS and not any(line.startswith("## ") for line in lines):
        found.append(f"{path}:1: {words} words and no ## subheading: split the page into sections")
    return found


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def main(paths: list[str]) -> int:
    root = Path(__file__).resolve().parents[2]
    pages = [Path(p) for p in paths] or [*sorted((root / "docs").glob("*.md")), root / "CHANGELOG.md"]
    found = [fault for page in pages for fault in faults(page)]
    print("\n".join(found))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
