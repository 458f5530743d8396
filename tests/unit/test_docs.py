"""The README is a front door a newcomer reads in minutes; every page and file it links exists; the docs site's
pages are all in its navigation. (``make docs`` builds the site in strict mode: broken links and API references
fail it.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 250


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/ (<= 250)"


README_MAX_WORDS = 1500  # issue 97, item 7
PARAGRAPH_MAX_WORDS = 80  # issue 97, item 3


def test_the_readme_says_what_it_is_for_whom_and_its_two_commands_on_its_first_screen():
    """Issue 97, item 3: within the first 30 lines, what it is, whether it is for you (the verdict's condition, the
    planner command that gives it, the limitations page) and the two commands; no paragraph or list item over 80
    words in the whole README, and at most 1,500 words."""
    text = (ROOT / "README.md").read_text()
    first = "\n".join(text.splitlines()[:30])
    for needed in ('Trainer(strategy="pd2bw")', "Is it for you?", "pd2bw-plan", "docs/limitations.md"):
        assert needed in first, f"{needed!r} is not on the README's first screen"
    assert re.search(r"^make train ", first, re.M) and re.search(r"^make test ", first, re.M), first
    assert len(text.split()) <= README_MAX_WORDS, f"README.md has {len(text.split())} words (<= {README_MAX_WORDS})"
    blocks, fenced = [], False
    for block in re.split(r"\n\s*\n", text):
        if block.lstrip().startswith("```"):
            fenced = block.count("```") % 2 == 1
            continue
        if fenced or block.lstrip().startswith(("|", "<!--", "![", "#")):
            fenced = fenced and block.count("```") % 2 == 0
            continue
        blocks += re.split(r"\n(?=- )", block)  # a list's items, each its own
    long = [b[:60] for b in blocks if len(b.split()) > PARAGRAPH_MAX_WORDS]
    assert not long, f"README paragraphs over {PARAGRAPH_MAX_WORDS} words: {long}"


def test_every_relative_link_of_the_readme_exists():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert len(links) >= 10
    missing = [link for link in links if not link.startswith("http") and not (ROOT / link).exists()]
    assert not missing, f"README.md links to missing files: {missing}"


def test_every_docs_page_is_in_the_site_navigation():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def pages_of(entries: list) -> set[str]:  # the nav's sections (Learn, How-to, ...) hold pages
        found: set[str] = set()
        for entry in entries:
            value = next(iter(entry.values()))
            found |= pages_of(value) if isinstance(value, list) else {value}
        return found

    listed = pages_of(config["nav"])
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages == listed, (
        f"pages not in mkdocs.yml's nav: {pages - listed}; nav entries without a page: {listed - pages}"
    )
    assert config["strict"] is True and config["validation"]["anchors"] == "warn"


def test_the_docs_name_the_pages_the_issue_asks_for():
    pages = {p.stem for p in (ROOT / "docs").glob("*.md")}
    assert {"getting-started", "models", "2bw-vs-flush", "quality", "sparsity", "configuration", "planner"} <= pages
    assert {"checkpoints", "reliability", "gpus", "benchmarks", "architecture", "api"} <= pages
    gpus = (ROOT / "docs" / "gpus.md").read_text()
    assert "#SBATCH" in gpus and "torchrun --nnodes" in gpus
    models = (ROOT / "docs" / "models.md").read_text()
    assert "layer(*value)" in models and "load_from_checkpoint" in (ROOT / "docs" / "checkpoints.md").read_text()


def _api_objects():
    """What ``docs/api.md`` renders (each ``::: path``, a module's public classes and functions), loaded by griffe
    with the site's extension, as mkdocstrings sees them."""
    import griffe

    extensions = griffe.load_extensions(f"{ROOT}/docs/_ext/api_tables.py:OptionsTables")
    package = griffe.load("lightning_pd2bw", search_paths=[str(ROOT)], docstring_parser="google", extensions=extensions)
    for path in re.findall(r"^::: (\S+)", (ROOT / "docs" / "api.md").read_text(), re.M):
        obj = package[path.removeprefix("lightning_pd2bw.")]
        if obj.is_module:
            yield from (
                m.final_target
                for n, m in obj.members.items()
                if not n.startswith("_") and (m.is_class or m.is_function)
            )
        else:
            yield obj


def test_the_api_reference_has_a_parameter_table_for_every_public_class_and_function():
    """Issue 49, item 3: every constructor's (and function's) parameters documented, one entry each, so the site
    shows a table of name, type, default and description; the strategy's come from ``PipelineOptions``."""
    checked, gaps = 0, {}
    for obj in _api_objects():
        callable_ = obj.members.get("__init__") if obj.is_class else obj
        if callable_ is None:
            continue
        names = [p.name for p in callable_.parameters if p.name != "self"]
        documented = set()
        for part in (obj, callable_):
            for section in part.docstring.parse("google") if part.docstring else []:
                if section.kind.value == "parameters":
                    documented |= {p.name.lstrip("*") for p in section.value}
        checked += 1
        if missing := [n for n in names if n not in documented]:
            gaps[obj.path] = missing
    assert checked >= 20 and not gaps, f"parameters without a description in the API reference: {gaps}"


def _lint():
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_lint", ROOT / "docs" / "_ext" / "lint.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_markdown_lint_finds_what_the_strict_build_does_not(tmp_path):
    """Issue 49, item 4: a list right after a paragraph line (rendered as run-on text), a code line wider than the
    content column (clipped), a long page without sections; a list after a blank line, a nested list and a list
    item's continuation pass."""
    lint = _lint()
    page = tmp_path / "page.md"
    code = "x" * (lint.CODE_WIDTH + 1)
    page.write_text(f"# T\n\nText:\n- item\n\nText.\n\n- fine\n  continued\n- next\n\n```\n{code}\n```\n" + "w " * 500)
    found = lint.faults(page)
    assert len(found) == 3, found
    assert ":4: a list item right after a paragraph" in found[0] and ":13: code line of 121" in found[1]
    assert "no ## subheading" in found[2]


@pytest.mark.parametrize(
    "page",
    [
        "- a\n\n  ```\n  x\n  ```\n- b\n- c\n",  # after a code block inside an item
        "| a | b |\n|---|---|\n| 1 | 2 |\n- b\n- c\n",  # after a table: the items become its rows
        "- a\n\n  | a | b |\n  |---|---|\n  | 1 | 2 |\n- b\n",  # after an indented table
        "- a\n\n    a later paragraph\n- b\n- c\n",  # after an item's second paragraph
        "1. a\n\n   more\n2. b\n",
        "## H\n- a\n- b\n",  # fine: a heading is a block of its own
        "- a\n  continued\n- b\n",  # fine: the item's own paragraph
        "Text:\n\n- a\n- b\n\n  later\n\n- c\n",  # fine: a blank line before each
    ],
)
def test_the_lint_flags_a_list_exactly_where_markdown_runs_it_on(tmp_path, page):
    """Issue 63, 2: the lint flags a list item exactly where Python-Markdown (the site's renderer, with the site's
    extensions) does not render it as one: its items counted against the ``<li>`` it renders."""
    import re

    import markdown

    path = tmp_path / "page.md"
    path.write_text(page)
    items = sum(bool(_lint().ITEM.match(line)) for line in page.splitlines())
    rendered = markdown.markdown(page, extensions=["tables", "admonition", "pymdownx.superfences"])
    run_on = len(re.findall(r"<li>", rendered)) < items
    assert bool(_lint().faults(path)) == run_on, (rendered, _lint().faults(path))


def test_the_lint_refuses_history_on_a_page_of_the_current_state(tmp_path):
    """Issue 97, item 1: "since 0.x", "until 0.x", "previously", "used to", "(was ..." outside code blocks are faults
    on the pages that state the current state (``main`` leaves out the changelog and the Results log's pages)."""
    path = tmp_path / "page.md"
    path.write_text("# T\n\nSince 0.15.0 it plans.\n\n```\nsince 0.1 in code\n```\nThe rate (was 6e-4) moved.\n")
    found = _lint().history_words(path)
    assert [f.split(": ")[0].rsplit(":", 1)[1] for f in found] == ["3", "8"], found


def test_the_lint_counts_each_table_rows_cells(tmp_path):
    """A row with more or fewer cells than its header (the site drops or pads them); escaped pipes and pipes in
    inline code are not cell borders."""
    path = tmp_path / "page.md"
    path.write_text("| a | b |\n|---|---|\n| `x|y` | a \\| b |\n| 1 | 2 | 3 |\n\n| c |\n|---|\n| 1 |\n")
    found = _lint().faults(path)
    assert len(found) == 1 and ":4: a table row of 3 cells under a header of 2" in found[0], found


def test_the_lint_refuses_paragraphs_in_cells_and_pages_too_long_to_read(tmp_path):
    lint = _lint()
    path = tmp_path / "page.md"
    path.write_text(
        "## S\n\n| a | b |\n|---|---|\n| 1 | " + "w" * (lint.CELL_CHARS + 1) + " |\n\n" + "w " * lint.PAGE_WORDS
    )
    found = lint.faults(path)
    assert len(found) == 2 and ":5: a table cell of 401 characters" in found[0] and "words (> 3000)" in found[1], found


def test_the_page_length_counts_what_the_site_renders(tmp_path):
    """Issue 78: a page's words include its ``--8<--`` includes (generated tables, the changelog's rendered releases:
    docs/changelog.md is one line of source and was 8,207 words on the site), a named section only its own lines."""
    lint = _lint()
    (tmp_path / "long.md").write_text(
        "head\n<!-- --8<-- [start:kept] -->\n" + "w " * 50 + "\n<!-- --8<-- [end:kept] -->\n" + "x " * 900
    )
    page = tmp_path / "page.md"
    page.write_text('# P\n\n--8<-- "long.md:kept"\n\n--8<-- "long.md"\n')
    kept, whole = 50, 1 + 50 + 900  # the site drops the markers' lines
    assert lint.rendered_words(page, tmp_path) == 2 + kept + whole
    changelog = (ROOT / "CHANGELOG.md").read_text()
    latest = changelog.split("[start:latest]")[1].split("[end:latest]")[0]
    own = len((ROOT / "docs" / "changelog.md").read_text().split())
    assert lint.rendered_words(ROOT / "docs" / "changelog.md") > own + len(latest.split()) - 20, "the releases counted"


def test_every_docs_page_passes_the_markdown_lint():
    lint = _lint()
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert [f for page in pages for f in lint.faults(page)] == []


def test_every_action_the_docs_name_is_a_kind_of_the_ir():
    """An action written as the IR prints it (``REDUCE(b1)``, ``SEND_F(m4,v1)``) names a ``schedule.Kind``: a
    renamed or removed kind cannot linger in the prose (issue 61)."""
    import re

    from lightning_pd2bw.engine.schedules.schedule import Kind

    kinds = {kind.value for kind in Kind}
    named: dict[str, set[str]] = {}
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for name in re.findall(r"\b([A-Z][A-Z_]*)\((?:b|m)[\d+a-z ,-]*\)", page.read_text()):
            named.setdefault(name, set()).add(page.name)
    assert named, "the docs show the IR's actions (docs/architecture.md)"
    unknown = {name: sorted(pages) for name, pages in named.items() if name not in kinds}
    assert not unknown, f"actions the IR does not have: {unknown}"


def test_every_package_module_is_in_the_architecture_page():
    """``docs/architecture.md``'s map names every module of the package under its own folder's entry (issue 61: it
    lacked ``engine/sharding.py``; issue 79: 20 modules outside ``engine/`` were unnamed). An entry is a line of the
    map's tree indented two spaces and the lines indented more below it; a module at the top names its own entry."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    tree = page.split("```")[1]
    entries: dict[str, str] = {}
    for line in tree.splitlines()[2:]:  # after "lightning_pd2bw/"
        if line.startswith("  ") and not line.startswith("   "):
            name = line.split()[0]
            entries[name] = line
        elif entries:
            entries[name] += "\n" + line
    package = ROOT / "lightning_pd2bw"
    missing = []
    for module in sorted(package.rglob("*.py")):
        relative = module.relative_to(package)
        if module.name == "__init__.py" and len(relative.parts) > 1:
            continue
        entry = entries.get(relative.name if len(relative.parts) == 1 else f"{relative.parts[0]}/", "")
        if relative.as_posix().split("/", 1)[-1] not in entry and module.name not in entry:
            missing.append(relative.as_posix())
    assert not missing, f"docs/architecture.md's map does not name {missing}"


def test_the_readmes_test_times_are_the_recorded_ones():
    """The README's tier times are read from ``tests/durations.json`` (what ``make test`` and ``make test-full``,
    CI's command, wrote last, rewriting these rows), not typed: each row's pytest seconds, tests passed and date are
    the record's."""
    from tests.conftest import readme_with_times, recorded_durations

    record = recorded_durations()
    readme = (ROOT / "README.md").read_text()
    for command in ("make test", "make test-full"):
        row = next(line for line in readme.splitlines() if line.startswith(f"| `{command}` |"))
        assert re.search(r"~\d+ min \(pytest \d+ s, \d+ passed; \d{4}-\d\d-\d\d", row), f"the {command} row"
    assert readme_with_times(readme, record) == readme, "the README's test times differ from tests/durations.json"


def test_the_lint_finds_a_file_the_docs_name_that_is_not_in_the_tree(tmp_path):
    """Issue 78: a moved or removed file left named in a page fails ``make docs``; a run's outputs do not."""
    lint = _lint()
    page = tmp_path / "page.md"
    page.write_text(
        "The IR is `engine/schedules/schedule.py`; the recipe `conf/model/gpt13b.yaml`; a run writes `outputs/RUN/x.json`.\n"
        "It was in `lightning_pd2bw/engine/old_schedule.py:12`.\n"
    )
    assert lint.missing_paths(page, ROOT) == [
        f"{page}:2: `lightning_pd2bw/engine/old_schedule.py` is not in the tree: name the file as it is now"
    ]
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert [fault for p in pages for fault in lint.missing_paths(p, ROOT)] == []


def test_the_schedule_pictures_are_what_the_generator_draws():
    """``docs/2bw-vs-flush.md`` shows Flush's and 2BW's timelines as ``make schedules`` prints them, from the schedule
    generator itself: a change to the schedules that moves a slot fails here until the page is regenerated."""
    from lightning_pd2bw.observe.draw import render

    page = (ROOT / "docs" / "2bw-vs-flush.md").read_text()
    shown = page.split("```\nflush (d=4", 1)[1].split("```", 1)[0]
    assert "flush (d=4" + shown == render("flush", 4, 4, 2) + "\n\n" + render("2bw", 4, 4, 3) + "\n"
    split = page.split("```\nflush (d=4, m=8", 1)[1].split("```", 1)[0]
    assert "flush (d=4, m=8" + split == render("flush", 4, 8, 1, 2) + "\n\n" + render("zb_h1", 4, 8, 1) + "\n"


def test_the_lint_holds_the_whole_manual_under_its_budget_the_results_log_included(tmp_path, monkeypatch):
    """Issue 78, item 7: every page of the navigation counts against one budget, the Results log's too (it is reported
    apart); the repository's manual is within it."""
    lint = _lint()
    monkeypatch.setattr(lint, "MANUAL_WORDS", 100)
    (tmp_path / "docs").mkdir()
    nav = "nav:\n  - Home: index.md\n  - Learn:\n      - A: a.md\n  - Results:\n      - Results log:\n          - L: log.md\n"
    (tmp_path / "mkdocs.yml").write_text(nav)
    for name, words in [("index.md", 40), ("a.md", 50), ("log.md", 10)]:
        (tmp_path / "docs" / name).write_text("w " * words)
    manual, log = lint.manual_pages(tmp_path / "mkdocs.yml")
    assert [p.name for p in manual] == ["index.md", "a.md"] and [p.name for p in log] == ["log.md"]
    assert lint.manual_size(tmp_path / "mkdocs.yml") == []
    (tmp_path / "docs" / "log.md").write_text("w " * 11)  # a log page's words count like any other's
    (fault,) = lint.manual_size(tmp_path / "mkdocs.yml")
    assert "101 words (> 100; 11 of them in the Results log)" in fault and "a.md 50" in fault
    monkeypatch.undo()
    assert lint.manual_size(ROOT / "mkdocs.yml") == []


def test_the_lint_names_an_option_key_no_group_has(tmp_path):
    """Issue 78, item 3: inline code naming an option key is resolved against every group option's composed
    configuration (the models' config fields included); a renamed or misspelt key is named with its line."""
    lint = _lint()
    keys = lint.option_keys(ROOT)
    assert {"strategy.sync_steps", "sparsity.kernels", "model.config.gelu", "cluster.latency"} <= keys
    page = tmp_path / "page.md"
    page.write_text(
        "Set `strategy.sync_steps=250` and `sparsity.kernels=true`; `trainer.pt` is a file.\n"
        "Then `strategy.sync_step=250` and `+model.config.n_embed=384`.\n"
    )
    assert lint.unknown_options([page], keys) == [
        f"{page}:2: `strategy.sync_step` is not an option of any group in conf/: name the key as it is now",
        f"{page}:2: `model.config.n_embed` is not an option of any group in conf/: name the key as it is now",
    ]
    assert lint.unknown_options([ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))], keys) == []


def _two_stage_listing(mode: str, num_microbatches: int, step: int) -> str:
    """What ``schedule.listing`` prints for each stage of a depth-2 run's training step ``step`` (``engine.actions``:
    the engine alone, no stop flag), side by side."""
    from lightning_pd2bw.engine.layout import Layout
    from lightning_pd2bw.engine.schedules import program
    from lightning_pd2bw.engine.schedules.actions import listing

    layout = Layout(num_stages=2, num_microbatches=num_microbatches, mode=mode)
    first, second = (listing(program.train_step(layout, stage, step)).splitlines() for stage in (0, 1))
    return "\n".join([f"{'stage 0':29s}stage 1", *(f"{a:29s}{b}".rstrip() for a, b in zip(first, second))])


def test_the_architecture_pages_action_listing_is_what_the_schedule_prints():
    """Issue 78, item 2: ``docs/architecture.md``'s listing of a 2BW step is the schedule's own (it had kept CLIP and
    STEP at the head of the step and no PUBLISH, two releases after both moved)."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    shown = page.split("Step 2 of a 2BW run, d = 2, m = 2:\n\n```\n", 1)[1].split("```", 1)[0]
    assert shown.rstrip("\n") == _two_stage_listing("2bw", 2, 2)


def test_the_changelog_page_lists_every_release_with_its_upgrade_notes():
    """``docs/changelog.md`` renders every release of ``CHANGELOG.md`` (its title; its upgrade notes, changed
    defaults and breaking changes whole), generated by ``docs/_ext/changelog_releases.py`` and kept current."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "docs/_ext/changelog_releases.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    page = (ROOT / "docs" / "_generated" / "changelog-releases.md").read_text()
    changelog = (ROOT / "CHANGELOG.md").read_text()
    versions = re.findall(r"^## (\d+\.\d+\.\d+) \(", changelog, re.M)
    assert versions and all(f"- **{version}** (" in page for version in versions)
    assert "`sync_steps=0` keeps the paper's 2BW" in page  # 0.21.0's upgrade note, whole
    assert '--8<-- "docs/_generated/changelog-releases.md"' in (ROOT / "docs" / "changelog.md").read_text()
