"""Markdown faults the strict MkDocs build does not catch (``make docs`` runs this first; ``tests/unit/test_docs.py``).

- A list item right after a line that is not its list's own paragraph (a paragraph, a table row, a closing code
  fence, or an item's later paragraph), without a blank line between: Python-Markdown then renders the items as
  run-on text of that paragraph, or as rows of the table.
- A table row whose number of cells differs from its header's: the site drops or pads cells silently.
- A table cell over ``CELL_CHARS`` characters (a few lines of the site's column): a paragraph in a cell is read
  by no one; make it a list.
- A page over ``PAGE_WORDS`` words as the site renders it (every ``--8<--`` include counted: the generated tables,
  the changelog's rendered releases): too long to read; split what holds today from the dated results log.
- A code line longer than ``CODE_WIDTH`` characters: the site shows about that many before clipping at the right
  edge (Material's content column at a laptop's width).
- A page longer than about a screen (``SCREEN_WORDS``) without ``##`` subheadings: no table of contents to
  find one's way with.
- The manual (every page of the site's navigation, its ``Results log`` section of dated measurements included) over
  ``MANUAL_WORDS`` words as rendered: a fact added means an older one rewritten shorter, or a superseded measurement
  moved to the repository's history with the revision that holds it.
- An option key in inline code (``strategy.sync_steps``, ``sparsity.kernels=true``) that no group option's composed
  configuration has (every option of every group in ``conf/`` composed, the models' config fields added): a renamed
  or removed key left named. Names of that shape that are not keys are listed in ``NOT_OPTIONS`` with what they are.
- Words about what a default or a figure used to be ("since 0.x", "until 0.x", "previously", "used to", "(was ...")
  on a page that states the current state (not the changelog, not a page of the Results log): history lives there.
- A file path in inline code (``lightning_pd2bw/engine/schedule.py``, ``conf/model/gpt13b.yaml``) that is not in the
  tree: a moved or removed file left named (a run's outputs, ``outputs/...``, and the changelog's history excepted).

    python docs/_ext/lint.py            # every page of docs/; exit 1 listing each fault as file:line: what
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

CODE_WIDTH = 120
SCREEN_WORDS = 400
CELL_CHARS = 400
PAGE_WORDS = 3000
MANUAL_WORDS = 45000  # issue 78, item 7: the whole manual's size when the issue was filed, the Results log included
LOG_SECTION = "Results log"  # mkdocs.yml's navigation section of dated measurements (counted, reported apart)
ITEM = re.compile(r"^\s*(?:[-*+]|\d+\.)\s+\S")
PATH = re.compile(r"`([A-Za-z0-9_./-]+/[A-Za-z0-9_.-]+\.(?:py|md|yaml|json|png|sh|toml|cff|txt))(?::[\d,-]+)?`")
SEARCHED = ("", "lightning_pd2bw", "docs", "conf", "tests")  # where a path in the docs is read from
OPTION = re.compile(
    r"`\+?((?:model|data|strategy|sparsity|trainer|logger|callbacks|paths|cluster)\.[A-Za-z_][\w.]*)(?:=[^`]*)?`"
)
NOT_OPTIONS = {  # inline code shaped like an option key that names something else
    "model.lrr": "the bad-input example: a misspelt key, which Hydra refuses by name",
    "model.safetensors": "a Hugging Face directory's weights file",
    "trainer.pt": "the file of a checkpoint that holds Lightning's loops",
    "trainer.predict": "Lightning's Trainer.predict",
}
MARKER = re.compile(r"--8<-- \[(start|end):([\w-]+)\]")  # a section's bounds in an included file
INCLUDE = re.compile(r'^\s*--8<--\s+"([^"]+)"\s*$')  # pymdownx.snippets: "file" or "file:section"


def rendered_words(path: Path, root: Path | None = None) -> int:
    """The words of ``path`` as the site renders it: each ``--8<-- "file"`` line replaced by that file (relative to
    the repository root), ``"file:name"`` by its lines between ``--8<-- [start:name]`` and ``[end:name]``."""
    root = root or Path(__file__).resolve().parents[2]
    words = 0
    for line in path.read_text().splitlines():
        included = INCLUDE.match(line)
        if included is None:
            words += len(line.split())
            continue
        name, _, section = included.group(1).partition(":")
        inside = not section
        for text in (root / name).read_text().splitlines():
            marker = MARKER.search(text)
            if marker is not None:  # the site drops a section's marker lines
                inside = inside or marker.group(2) == section and marker.group(1) == "start"
                inside = inside and not (marker.group(2) == section and marker.group(1) == "end")
            elif inside:
                words += len(text.split())
    return words


def faults(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    found, fenced, previous = [], False, ""
    chained = False  # the previous line continues a list item's first paragraph (an item may follow it directly)
    header_cells = None  # the cells of the table being read
    for number, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fenced, previous, chained = not fenced, "```", False
            continue
        if fenced:
            if len(line) > CODE_WIDTH:
                found.append(f"{path}:{number}: code line of {len(line)} characters (> {CODE_WIDTH}): it is clipped")
            continue
        is_row = line.lstrip().startswith("|")
        if is_row:
            cells = _cells(line)
            if header_cells is None:
                header_cells = cells
            elif cells != header_cells:
                found.append(f"{path}:{number}: a table row of {cells} cells under a header of {header_cells}")
            widest = max(len(cell.strip()) for cell in re.sub(r"`[^`]*`", _code, line.strip()).strip("|").split("|"))
            if widest > CELL_CHARS:
                found.append(f"{path}:{number}: a table cell of {widest} characters (> {CELL_CHARS}): make it a list")
        else:
            header_cells = None
        if ITEM.match(line):
            if previous and not chained and not previous.lstrip().startswith(("#", "<")):
                found.append(f"{path}:{number}: a list item right after a paragraph, table or code block: put a blank "
                             "line before it")  # fmt: skip
            chained = True
        elif not line.strip() or is_row:
            chained = False
        previous = line if line.strip() else ""
    words = sum(len(line.split()) for line in lines)
    if words > SCREEN_WORDS and not any(line.startswith("## ") for line in lines):
        found.append(f"{path}:1: {words} words and no ## subheading: split the page into sections")
    rendered = rendered_words(path) if path.name != "CHANGELOG.md" else 0  # the file read by release; its page counts
    if rendered > PAGE_WORDS:
        found.append(f"{path}:1: {rendered} words (> {PAGE_WORDS}) as rendered: split what holds today from a dated "
                     "results log")  # fmt: skip
    return found


def missing_paths(path: Path, root: Path) -> list[str]:
    """Each file path named in inline code that exists under none of ``SEARCHED`` (outputs excepted)."""
    found = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        for name in PATH.findall(line):
            if name.startswith(("/", "outputs/", "build/")) or any((root / base / name).exists() for base in SEARCHED):
                continue
            found.append(f"{path}:{number}: `{name}` is not in the tree: name the file as it is now")
    return found


def option_keys(root: Path) -> set[str]:
    """Every key ``pd2bw-train`` accepts: each option of each group in ``conf/`` composed over the default recipe
    (its schema merged in), flattened to dotted names, and every field of the models' configs under ``model.config``."""
    import dataclasses

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from lightning_pd2bw.cli.train import CONF, RECIPES, setup_hydra
    from lightning_pd2bw.models.core import BERTConfig, GPTConfig

    def dotted(node: object, prefix: str) -> set[str]:
        if not isinstance(node, dict):
            return set()
        return {name for key, value in node.items() for name in {f"{prefix}{key}", *dotted(value, f"{prefix}{key}.")}}

    setup_hydra()
    keys: set[str] = set()
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        for group in sorted(p for p in CONF.iterdir() if p.is_dir()):
            for option in sorted(group.glob("*.yaml")):
                choice = f"{'+' if group.name == 'cluster' else ''}{group.name}={option.stem}"
                cfg = compose(config_name="tiny", overrides=[f"hydra.searchpath=[file://{CONF}]", choice])
                keys |= dotted(OmegaConf.to_container(cfg, resolve=False), "")
    fields = {f.name for config in (GPTConfig, BERTConfig) for f in dataclasses.fields(config)}
    return keys | {f"model.config.{name}" for name in fields}


def unknown_options(pages: list[Path], keys: set[str]) -> list[str]:
    """Each option key named in inline code that is not in ``keys`` (nor in ``NOT_OPTIONS``)."""
    return [
        f"{page}:{number}: `{key}` is not an option of any group in conf/: name the key as it is now"
        for page in pages
        for number, line in enumerate(page.read_text().splitlines(), 1)
        for key in OPTION.findall(line)
        if key not in keys and key not in NOT_OPTIONS
    ]


def _code(match: re.Match) -> str:
    return "x" * len(match.group())  # inline code: its length counts, its pipes do not


def _cells(row: str) -> int:
    """The cells of a table row: its pipes outside inline code, less the one that closes the row."""
    text = re.sub(r"`[^`]*`", "", row.strip().replace("\\|", ""))
    return text.count("|") - (1 if text.endswith("|") else 0)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def manual_pages(mkdocs: Path) -> tuple[list[Path], list[Path]]:
    """The site's pages (``mkdocs.yml``'s navigation) split into the manual and the ``Results log`` section."""
    import yaml

    def pages(entry) -> list[str]:
        if isinstance(entry, str):
            return [entry]
        children = entry if isinstance(entry, list) else list(entry.values())
        return [page for child in children for page in pages(child)]

    def sections(entry) -> list:  # every (nested) navigation entry that is a section of its own
        children = entry if isinstance(entry, list) else list(entry.values()) if isinstance(entry, dict) else []
        own = [entry] if isinstance(entry, dict) else []
        return own + [section for child in children for section in sections(child)]

    nav = yaml.safe_load(mkdocs.read_text())["nav"]
    log = [page for section in sections(nav) if LOG_SECTION in section for page in pages(section[LOG_SECTION])]
    manual = [page for page in pages(nav) if page not in log]
    docs = mkdocs.parent / "docs"
    return [docs / page for page in manual], [docs / page for page in log]


def manual_size(mkdocs: Path) -> list[str]:
    """A fault when the manual (every page of the navigation, the Results log included) renders to more than
    ``MANUAL_WORDS`` words."""
    manual, log = manual_pages(mkdocs)
    counts = {page: rendered_words(page) for page in manual + log}
    words = sum(counts.values())
    if words <= MANUAL_WORDS:
        return []
    largest = ", ".join(f"{p.name} {w}" for p, w in sorted(counts.items(), key=lambda item: -item[1])[:3])
    in_log = sum(counts[page] for page in log)
    return [
        f"{mkdocs}:1: the manual renders to {words} words (> {MANUAL_WORDS}; {in_log} of them in the {LOG_SECTION}): "
        f"shorten a page (largest: {largest}), or move a superseded measurement to the repository's history"
    ]


HISTORY = re.compile(r"\b(?:[Ss]ince|[Uu]ntil) 0\.\d+|\b[Pp]reviously\b|\bused to\b|\(was ")


def history_words(path: Path) -> list[str]:
    """Lines outside code blocks that narrate what used to be (``HISTORY``)."""
    found, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (match := HISTORY.search(line)):
            found.append(
                f"{path}:{number}: {match.group(0)!r}: say what holds now; history is the changelog's and the logs'"
            )
    return found


def main(paths: list[str]) -> int:
    root = Path(__file__).resolve().parents[2]
    pages = [Path(p) for p in paths] or [*sorted((root / "docs").glob("*.md")), root / "CHANGELOG.md"]
    found = [fault for page in pages for fault in faults(page)]
    found += [] if paths else manual_size(root / "mkdocs.yml")
    current = [page for page in [root / "README.md", *pages] if page.name != "CHANGELOG.md"]  # not the history
    found += [f for page in current for f in missing_paths(page, root)]
    found += [] if paths else unknown_options(current, option_keys(root))
    logs = set(manual_pages(root / "mkdocs.yml")[1])
    found += [f for page in current if page not in logs for f in history_words(page)]
    print("\n".join(found))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
