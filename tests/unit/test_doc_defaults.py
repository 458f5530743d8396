"""Issue 97, item 2: every default a page states in its marked form is the code's. The marked form is an option
in inline code with its value, followed by "(default", "(the default", ", the default" or ", every recipe's
default": ``strategy.on_nonfinite=stop`` (default). Each is read from the default recipe's composed configuration
(``pd2bw-train`` with no recipe; "every recipe's": each recipe's) and, for a ``strategy.*`` key,
``PipeDream2BWStrategy``'s signature, and a page that states another value fails here."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lightning_pd2bw import PipeDream2BWStrategy
from lightning_pd2bw.cli.train import CONF, RECIPES, recipe_names, setup_hydra

ROOT = Path(__file__).resolve().parents[2]
MARKED = re.compile(
    r"`((?:model|data|strategy|sparsity|trainer)\.[\w.]+)=([^`]+)`"
    r"(?: \((?:the )?default\b|, the default\b|, (every recipe)'s default\b)"
)

setup_hydra()


def stated_defaults() -> list[tuple[str, str, str, bool]]:
    """(page, key, value, of every recipe) for each marked default of the README and the docs' pages."""
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for match in MARKED.finditer(page.read_text()):
            found.append((page.name, match.group(1), match.group(2), match.group(3) is not None))
    return found


STATED = stated_defaults()


def composed(recipe: str):
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        return compose(config_name=recipe, overrides=[f"hydra.searchpath=[file://{CONF}]"])


def test_the_pages_mark_their_defaults():
    assert len(STATED) >= 4, STATED


@pytest.mark.parametrize("page,key,value,every", STATED, ids=[f"{p}:{k}" for p, k, _, _ in STATED])
def test_a_stated_default_is_the_codes(page, key, value, every):
    stated = yaml.safe_load(value)
    for recipe in recipe_names() if every else ["tiny"]:
        actual = OmegaConf.select(composed(recipe), key)
        assert actual == stated, f"{page} says {key}={value} is the default; recipe={recipe} composes {actual!r}"
    name = key.split(".", 1)[1]
    parameters = inspect.signature(PipeDream2BWStrategy.__init__).parameters
    if key.startswith("strategy.") and name in parameters:
        assert parameters[name].default == stated, f"{page}: PipeDream2BWStrategy({name}=...) defaults otherwise"


def test_a_wrong_default_is_caught(tmp_path):
    """The check itself: a page stating another value than the code's is a mismatch."""
    text = "`strategy.on_nonfinite=skip` (the default)"
    match = MARKED.search(text)
    assert match and OmegaConf.select(composed("tiny"), match.group(1)) != yaml.safe_load(match.group(2))


def test_the_readmes_python_snippet_runs_the_main_jobs_settings():
    """Issue 97, item 3: the README's Python snippet trains as ``pd2bw-train`` does (the default recipe's model, peak
    rate and warm-up; the strategy's defaults, the synchronous start included)."""
    snippet = re.search(
        r'GPT\(GPTConfig\.from_name\("(\w+)"\), lr=([\d.e-]+), warmup_steps=(\d+)', (ROOT / "README.md").read_text()
    )
    assert snippet, "the README's snippet builds GPT(GPTConfig.from_name(...), lr=..., warmup_steps=...)"
    cfg = composed("tiny")
    assert snippet.group(1) == cfg.model.config.name
    assert float(snippet.group(2)) == cfg.model.lr and int(snippet.group(3)) == cfg.model.warmup_steps


def test_the_key_table_is_what_the_configuration_composes():
    """Issue 97, item 2: ``docs/configuration.md``'s key table (``docs/_generated/configuration-keys.md``) is generated
    from the composed default recipe: every key, its value, one line; a key added, removed or defaulted otherwise
    makes it stale here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("config_keys", ROOT / "docs" / "_ext" / "config_keys.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    generated = module.table()
    assert module.OUT.read_text() == generated, "stale: run python docs/_ext/config_keys.py"
    keys = [line.split("=", 1)[0] for line in generated.splitlines()]
    assert {"strategy.sync_steps", "strategy.group_creation", "model.lr", "trainer.max_steps"} <= set(keys)
    assert len(keys) == len(set(keys)) >= 90
