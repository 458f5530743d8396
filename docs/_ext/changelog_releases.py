"""Every release on the changelog page: its title, and what an upgrader must know (its upgrade notes, changed
defaults, changed or breaking behaviour) quoted from ``CHANGELOG.md``, newest first. The latest release is rendered
whole above it (``docs/changelog.md``).

    python docs/_ext/changelog_releases.py           # writes docs/_generated/changelog-releases.md
    python docs/_ext/changelog_releases.py --check   # fails where the page is not what CHANGELOG.md says
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHANGELOG = ROOT / "CHANGELOG.md"
OUT = ROOT / "docs" / "_generated" / "changelog-releases.md"
RELEASE = re.compile(r"^## (\d+\.\d+\.\d+) \(([\d-]+)\)(?:: (.*))?$")
# a paragraph an upgrader needs: it opens with one of these labels, or says it breaks something
UPGRADE = re.compile(r"^\*\*(Upgrade notes|Changed defaults|Changed|Breaking|Removed|Renamed)\b|\*\*Breaking")


def releases(text: str) -> list[tuple[str, str, str, list[str]]]:
    """(version, date, title, the upgrade paragraphs) of every release in ``text``, in its order."""
    found: list[tuple[str, str, str, list[str]]] = []
    for block in re.split(r"\n(?=## \d)", text):
        head, _, body = block.partition("\n")
        match = RELEASE.match(head.strip())
        if match is None:
            continue
        paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", body) if p.strip()]
        notes = [p for p in paragraphs if UPGRADE.search(p) and not p.startswith("<!--")]
        found.append((match[1], match[2], match[3] or "", notes))
    return found


def page(text: str) -> str:
    lines = [
        "Each release's title and what an upgrader must know (the whole entries: `CHANGELOG.md`), newest first:",
        "",
    ]
    for version, date, title, notes in releases(text):
        lines.append(f"- **{version}** ({date}){': ' + title if title else ''}")
        lines += [f"    {note}" for note in notes]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    wanted = page(CHANGELOG.read_text())
    if args.check:
        if not OUT.exists() or OUT.read_text() != wanted:
            print(f"{OUT.relative_to(ROOT)} is stale: run python docs/_ext/changelog_releases.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(wanted)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
