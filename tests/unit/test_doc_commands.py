"""Issue 49, item 1: every command the README and the docs show works from a fresh clone, read from the pages
themselves (code blocks, backslash continuations joined, and inline ``pd2bw-*``/``make`` commands in prose).

- ``pd2bw-train`` / ``python -m lightning_pd2bw.train`` / ``make train ARGS="..."``: the overrides compose against
  the schemas and pass the checks ``pd2bw-train`` runs before any process starts (a command that names the
  user's own files, e.g. ``data.path=/corpus``, only has to compose);
- ``pd2bw-plan``: the same, with ``cluster=NAME`` a preset;
- ``make TARGET``: a target of the Makefile;
- ``python FILE`` / ``torchrun ... FILE`` / ``pd2bw-consolidate`` / ``pd2bw-prepare-data``: the file exists and
  every ``--option`` it is given is one it parses;
- ``pip install -e ".[extras]"``: each extra exists;
- a usage pattern (``pd2bw-train [recipe=NAME] [overrides]``, ``ARGS="..."``): its tool is one of ours.

Running the README's main job and its consolidate line is ``tests/distributed/test_launchers.py``'s."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from lightning_pd2bw.cli.checks import ConfigError, check_run
from lightning_pd2bw.cli.model_profile import build_model_on_meta
from lightning_pd2bw.cli.plan import cluster_names
from lightning_pd2bw.cli.train import CONF, RECIPES, recipe_names, setup_hydra

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
START = re.compile(r"^\s*(?:\$\s+)?((?:[A-Z_]+=\S+\s+)*(?:make|pd2bw-[a-z-]+|python3?|torchrun|pip)\s.*)$")
INLINE = re.compile(r"`((?:pd2bw-(?:train|plan)|make [a-z-]+|python -m lightning_pd2bw\.train)(?: [^`]*)?)`")
PLACEHOLDER = re.compile(r"\.\.\.|[A-Z]{3,}_|<|RUN|PATH|NAME|OUT_DIR|YOUR")
TEMPLATE = re.compile(r"\.\.\.|\[[a-z]|=[A-Z]+\b")  # a usage pattern: `pd2bw-train [recipe=NAME] ...`, ARGS="..."
SCRIPTS = {
    "pd2bw-consolidate": "lightning_pd2bw/cli/consolidate.py",
    "pd2bw-prepare-data": "lightning_pd2bw/data/prepare.py",
}

setup_hydra()


def _code_lines(text: str) -> list[str]:
    lines, fenced, current = [], False, ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            continue
        current = f"{current} {line.strip()}" if current else line
        if current.rstrip().endswith("\\"):
            current = current.rstrip()[:-1]
            continue
        lines.append(current)
        current = ""
    return lines


def documented_commands() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for line in _code_lines(text):
            if match := START.match(line):
                found.append((page.name, re.split(r"\s+#\s", match.group(1))[0].strip()))
        found += [(page.name, m.group(1)) for m in INLINE.finditer(text)]
    return found


COMMANDS = documented_commands()


def _words(command: str) -> list[str]:
    words = shlex.split(command)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # OMP_NUM_THREADS=1 ...
        words = words[1:]
    return words


def _compose(overrides: list[str], cluster: bool = False):
    recipe = next((o.split("=", 1)[1] for o in overrides if o.startswith("recipe=")), "tiny")
    assert recipe in recipe_names(), f"recipe={recipe} is not a recipe"
    rest = [o for o in overrides if not o.startswith(("recipe=", "-"))]
    if cluster:
        for name in [o.split("=", 1)[1] for o in rest if o.startswith("cluster=")]:
            assert name in cluster_names(), f"cluster={name} is not a preset"
        rest = [f"+{o}" if o.startswith("cluster=") else o for o in rest]
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        return compose(config_name=recipe, overrides=[f"hydra.searchpath=[file://{CONF}]", *rest])


def _check_train(overrides: list[str], cluster: bool = False) -> None:
    cfg = _compose(overrides, cluster)
    own_files = any(
        PLACEHOLDER.search(o) or (("path" in o.split("=")[0] or o.startswith("init_from=")) and "=" in o)
        for o in overrides
    )
    try:
        check_run(cfg, num_layers=len(build_model_on_meta(cfg).pipeline_layers()))
    except (ConfigError, FileNotFoundError):
        if not own_files:  # a command on the user's own data only has to compose
            raise


def _check_options(path: Path, words: list[str]) -> None:
    assert path.is_file(), f"{path.relative_to(ROOT)} does not exist"
    source = path.read_text()
    for option in (w.split("=")[0] for w in words if w.startswith("--")):
        assert f'"{option}"' in source, f"{path.name} has no option {option}"


def _check(command: str) -> None:
    words = _words(command)
    tool, args = words[0], words[1:]
    if TEMPLATE.search(command) and tool != "pip":  # a pattern, not a command: its tool exists
        assert tool in ("make", "pd2bw-train", "pd2bw-plan", *SCRIPTS), f"{tool}: not a tool of this project"
        return
    if tool == "make":
        targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))
        assert args[0] in targets, f"make {args[0]}: no such target"
        extra = next((a.split("=", 1)[1] for a in args if a.startswith("ARGS=")), None)
        if args[0] == "train" and extra:
            _check_train(shlex.split(extra))
    elif tool == "pd2bw-train" or args[:2] == ["-m", "lightning_pd2bw.train"]:
        _check_train(args[2:] if tool.startswith("python") else args)
    elif tool == "pd2bw-plan":
        _check_train(args, cluster=True)
    elif tool in SCRIPTS:
        _check_options(ROOT / SCRIPTS[tool], args)
    elif tool in ("python", "python3") and args and args[0].endswith(".py"):
        _check_options(ROOT / args[0], args[1:])
    elif tool in ("python", "python3") and args[:1] == ["-m"]:
        module = args[1].replace(".", "/")
        _check_options(ROOT / f"{module}.py", args[2:])
    elif tool == "torchrun" and "lightning_pd2bw.train" in args:  # torchrun ... -m lightning_pd2bw.train OVERRIDES
        _check_train(args[args.index("lightning_pd2bw.train") + 1 :])
    elif tool == "torchrun":
        script = next(a for a in args if a.endswith(".py"))
        _check_options(ROOT / script, args[args.index(script) + 1 :])
    elif tool == "pip":
        extras = re.findall(r"\.\[([a-z,]+)\]", command)
        declared = (ROOT / "pyproject.toml").read_text()
        for extra in (e for group in extras for e in group.split(",")):
            assert re.search(rf"^{extra} = \[", declared, re.M), f"no extra [{extra}] in pyproject.toml"


def test_the_pages_show_commands_of_every_kind():
    tools = {_words(c)[0] for _, c in COMMANDS}
    assert {"make", "pd2bw-train", "pd2bw-plan", "pd2bw-consolidate", "pd2bw-prepare-data", "pip"} <= tools
    assert len(COMMANDS) >= 60


@pytest.mark.parametrize("page,command", COMMANDS, ids=[f"{p}:{c[:60]}" for p, c in COMMANDS])
def test_a_documented_command_works_from_a_fresh_clone(page, command):
    _check(command)
