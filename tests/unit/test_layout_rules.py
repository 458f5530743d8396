"""The house's static rules (DESIGN.md, "Architecture"), read from the source with ``ast``: the engine imports no
Lightning, Hydra or wandb; no import circles (lazy ones included); no upward imports; no file over 450 lines; at most two
modules beside ``__init__.py`` at the package's top level.
The strategy, a thin adapter over narrow components, stays under 400 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_pd2bw"
ENGINE = "engine"  # the Lightning-free engine's package
FRAMEWORKS = ("lightning", "pytorch_lightning", "lightning_fabric", "hydra", "omegaconf", "wandb")
MAX_LINES = 450


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(path: Path, top_level_only: bool) -> set[str]:
    """Absolute names of the modules ``path`` imports (``top_level_only``: at import time, not inside functions or
    under ``if TYPE_CHECKING``)."""
    tree = ast.parse(path.read_text())
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            found.add(prefix)
            found |= {f"{prefix}.{alias.name}" for alias in node.names}  # `from pkg import module`
    return found


def test_the_engine_imports_no_framework():
    for name, path in modules().items():
        if layer_of(name) in (ENGINE, "observe", "checkpoint"):
            bad = {m for m in imports_of(path, top_level_only=False) if m.split(".")[0] in FRAMEWORKS}
            assert not bad, f"{name} imports {sorted(bad)}: the engine (and what sits beside it) runs without Lightning"


def test_no_import_circles():
    """Function-level imports count too: a circle made lazy is still a circle in the design."""
    known = modules()
    graph = {
        # a module's own packages are initialised before it (``from . import x`` names one): not an edge
        name: {m for m in imports_of(path, top_level_only=False) if m in known and not name.startswith(m)}
        for name, path in known.items()
    }
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                cycle = trail[trail.index(nxt) :] + [nxt] if nxt in trail else [node, nxt]
                raise AssertionError(f"import circle: {' -> '.join(cycle)}")
            if nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])


# What each layer may import of the package (its own modules always): arrows point down only, cli -> lightning ->
# planner/models/data/sparsity -> observe -> engine -> checkpoint. The engine imports nothing of the package but the
# checkpoint format (its save/load), which imports nothing of the package; observe listens to the engine.
MAY_IMPORT = {
    ENGINE: {"checkpoint"},
    "observe": {ENGINE},
    "checkpoint": set(),
    "planner": {ENGINE, "observe"},
    "models": {ENGINE, "checkpoint"},
    "data": {"models"},
    "sparsity": {ENGINE, "checkpoint"},  # the engine's Precision: one rule for a precision's dtypes (issue 96)
    "lightning": {ENGINE, "observe", "checkpoint", "planner", "models", "data", "sparsity"},
    "cli": {ENGINE, "observe", "checkpoint", "planner", "models", "data", "sparsity", "lightning"},
}


def layer_of(name: str) -> str:
    return name.split(".")[1] if "." in name else ""


def test_every_folder_has_a_layer():
    folders = {p.parent.name for p in PACKAGE.glob("*/__init__.py")} - {"conf", "recipes"}
    assert folders == set(MAY_IMPORT), f"a folder without a place in MAY_IMPORT: {sorted(folders ^ set(MAY_IMPORT))}"


def test_no_upward_imports():
    """A layer imports only the layers below it (function-level imports included)."""
    for name, path in modules().items():
        layer = layer_of(name)
        if layer not in MAY_IMPORT:
            continue
        bad = {
            m
            for m in imports_of(path, top_level_only=False)
            if m.startswith(PACKAGE.name + ".")
            and layer_of(m) in MAY_IMPORT
            and layer_of(m) != layer
            and layer_of(m) not in MAY_IMPORT[layer]
        }
        assert not bad, f"{name} ({layer}/) imports {sorted(bad)}: only {sorted(MAY_IMPORT[layer]) or 'itself'} may be"


def test_no_file_over_450_lines():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_the_top_level_holds_one_module_and_no_shim():
    """``train.py`` (for ``torchrun -m lightning_pd2bw.train``) and ``errors.py`` (the refusal every layer raises,
    importing nothing); no module that maps old import paths (0.2.0
    removed ``moved.py``: a 0.x package announces a break in CHANGELOG.md instead)."""
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert top == ["errors.py", "train.py"], f"top-level modules: {top}"
    import sys

    import lightning_pd2bw  # noqa: F401

    finders = [type(f).__module__ for f in sys.meta_path]
    assert not any(m.startswith("lightning_pd2bw") and m != "lightning_pd2bw" for m in finders), finders


def test_the_strategy_is_a_thin_adapter():
    lines = len((PACKAGE / "lightning" / "strategy.py").read_text().splitlines())
    assert lines <= 400, f"lightning/strategy.py has {lines} lines: move a duty into a component beside it"


def python(code: str) -> str:
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip()


def test_the_engine_imports_neither_lightning_nor_hugging_face():
    """A plain PyTorch process (a torchrun worker of the engine) does not pay Lightning's and transformers' import
    (about 3 s of each process's start here); ``import lightning_pd2bw`` alone imports not even torch."""
    check = "import sys; print(sorted(m for m in ('lightning', 'transformers', 'torch') if m in sys.modules))"
    assert python(f"import lightning_pd2bw; {check}") == "[]"
    assert python(f"from lightning_pd2bw import PipelineEngine; {check}") == "['torch']"


@pytest.mark.parametrize(
    "first",
    [
        "import lightning_pd2bw",
        # the other orders in the full tier (~5 s each: a process that imports Lightning)
        pytest.param("import lightning", marks=pytest.mark.full),
        pytest.param("import lightning.pytorch", marks=pytest.mark.full),
        # its module imports Lightning: the hook runs inside it
        pytest.param("from lightning_pd2bw import PipeDream2BWStrategy", marks=pytest.mark.full),
        # as Hydra's _target_ does
        pytest.param("from lightning_pd2bw.lightning.strategy import PipeDream2BWStrategy", marks=pytest.mark.full),
        # a module of the adapter imports Lightning first: registering must not re-enter it half-run (it did)
        "import lightning_pd2bw.lightning.preemption",
        pytest.param("import lightning_pd2bw.lightning.compat", marks=pytest.mark.full),
    ],
)
def test_trainer_finds_the_strategy_whichever_is_imported_first(first):
    """``import lightning_pd2bw`` registers ``strategy="pd2bw"`` whether Lightning is imported before or after it."""
    code = (
        f"{first}\nimport lightning_pd2bw, lightning\n"
        "import lightning.pytorch as pl\n"
        "trainer = pl.Trainer(strategy='pd2bw', accelerator='cpu', devices=1, logger=False)\n"
        "print(type(trainer.strategy).__name__)"
    )
    assert python(code).splitlines()[-1] == "PipeDream2BWStrategy"


KEYWORD = "strategy.py:PipeDream2BWStrategy.__init__"  # where users type every option


def home_of(option: str) -> set[str]:
    """Where an option is defined (the engine's ``PipelineOptions``, its ``Clipping``, or the strategy's own
    ``StrategyOptions``) and where users type it (the strategy's keyword)."""
    from lightning_pd2bw.lightning.options import StrategyOptions

    owner = "StrategyOptions" if option in StrategyOptions.names() else "Clipping" if option == "clip_mode" else ""
    return {f"options.py:{owner or 'PipelineOptions'}", KEYWORD}


VIEWS = {  # where an option's name is also declared, and why: each a resolved or derived view, never a copy of it
    "layout.py:Layout": "the resolved layout (options.resolve(world).layout): depth, microbatches, mode, cut, lookahead",
    "layout.py:Keys": "how messages name the layout's options, not the options",
    "comm_plan.py:CommLayout": "the NCCL model's hypothetical run (layout sweeps without options)",
    "program.py:Scenario": "a run as its ranks' programs see it: the start's resolved steps, drains, the stop flag",
    "checks.py:RunLayout": "pd2bw-train's batch layout derived from the config (global, micro and per-replica batches)",
    "cost.py:Prediction": "the planner's output: the microbatches it chose",
    "candidate.py:Candidate": "the dimension the planner searches (recompute); the rest come from its options",
    "grid.py:ProcessGrid": "the process grid's geometry (world = depth x width)",
    "callbacks.py:RunMetrics.__init__": "the throughput callback's samples per step, given by pd2bw-train",
    "resilience.py:Resilience.__init__": "the strategy's failure and hang listeners, given the resolved timeouts",
    "watchdog.py:Watchdog.__init__": "the hang watchdog (observe/), given the resolved timeout",
}


def option_declarations() -> dict[str, set[str]]:
    """Every dataclass field and ``__init__`` parameter in the package named like an option's flat key (the keys
    of ``PipelineOptions`` and ``StrategyOptions``; ``Clipping.mode`` declares ``clip_mode``)."""
    from lightning_pd2bw.engine.options import PipelineOptions
    from lightning_pd2bw.lightning.options import StrategyOptions

    names = {*PipelineOptions.names(), *StrategyOptions.names()}
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for item in node.body:
                if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                    pass
                elif node.name == "Clipping" and item.target.id == "mode":
                    found.setdefault("clip_mode", set()).add(f"{path.name}:{node.name}")
                elif item.target.id in names:
                    found.setdefault(item.target.id, set()).add(f"{path.name}:{node.name}")
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    fields = {
                        f.target.id for f in node.body if isinstance(f, ast.AnnAssign) and hasattr(f.target, "id")
                    }
                    for arg in (*item.args.args, *item.args.kwonlyargs):
                        if arg.arg in names:  # a dataclass's own __init__ declares its fields once, not again
                            place = "" if arg.arg in fields else ".__init__"
                            found.setdefault(arg.arg, set()).add(f"{path.name}:{node.name}{place}")
    return found


def test_each_option_is_declared_in_its_home_and_named_views_only():
    """Issue 45: an option is declared where it is defined (``PipelineOptions``) and where users type it (the
    strategy's keyword); anything else that declares its name is one of the resolved or derived views named above,
    with the reason. The engine, the executor, the update and the schedules take the options or the ``Layout``."""
    declared = option_declarations()
    homeless = {k: v for k, v in declared.items() if not home_of(k) <= v}
    assert not homeless, homeless
    strays = {option: sorted(places - home_of(option) - set(VIEWS)) for option, places in declared.items()}
    assert not any(strays.values()), {k: v for k, v in strays.items() if v}
    engine_views = {"layout.py:Layout", "layout.py:Keys", "grid.py:ProcessGrid", "comm_plan.py:CommLayout"}
    engine_views |= {"program.py:Scenario"}
    in_engine = {place for places in declared.values() for place in places if place in VIEWS}
    in_engine = {p for p in in_engine if (PACKAGE / ENGINE).joinpath(p.split(":")[0]).exists() or "comm_plan" in p}
    assert in_engine <= engine_views, f"the engine's parts take the options or the Layout: {in_engine - engine_views}"
    executor = {p for places in declared.values() for p in places if p.startswith(("executor.py", "update.py"))}
    assert not executor, executor


# How many places declare each option's name today (``option_declarations``): a ratchet that only shrinks. A new
# declaration fails; one that goes away fails too, until this table is lowered to match (issue 61).
DECLARATIONS = {
    "async_checkpoint": 2,
    "boundary_dtype": 2,
    "clip_mode": 2,
    "compile": 2,
    "delay_correction": 2,
    "delay_correction_strength": 2,
    "failure_timeout": 3,
    "global_batch_size": 4,
    "grad_reduce_dtype": 2,  # 0.14.0: PipelineOptions and the strategy's keyword, as every engine option
    "group_creation": 2,  # 0.23.0: the same
    "hang_timeout": 4,
    "layers_per_stage": 4,
    "lookahead": 5,
    "mode": 5,
    "num_microbatches": 7,
    "num_stages": 7,
    "on_nonfinite": 2,
    "placement": 4,  # PipelineOptions, the strategy's keyword, the process grid and the NCCL model's CommLayout
    "plan": 2,
    "recompute": 2,  # 0.27.0: the planner's Candidate reads its Run's
    "requeue": 3,
    "shard_gradients": 3,
    "shard_optimizer": 3,
    "sync_steps": 4,  # PipelineOptions, the strategy's keyword; 0.25.0: the programs' Scenario and the NCCL model's
    "virtual_stages": 4,  # 0.24.0: PipelineOptions, the strategy's keyword, Layout; 0.26.0: the NCCL model's CommLayout
    "weight_dtype": 2,
}


def test_option_declarations_only_shrink():
    counts = {option: len(places) for option, places in option_declarations().items()}
    grown = {k: (DECLARATIONS.get(k, 0), n) for k, n in counts.items() if n > DECLARATIONS.get(k, 0)}
    assert not grown, f"(ratchet, now) declarations of an option's name grew: {grown}; take the options or a Run"
    shrunk = {k: (n, counts.get(k, 0)) for k, n in DECLARATIONS.items() if counts.get(k, 0) < n}
    assert not shrunk, f"(ratchet, now) fewer declarations: lower DECLARATIONS to match, it only shrinks: {shrunk}"
