"""Hydra configuration: every recipe and group option composes against its schema and passes the
cross-field checks; bad overrides and bad combinations fail with messages naming the key and fix."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from hydra.utils import instantiate
from omegaconf import OmegaConf

from lightning_pd2bw.cli.checks import ConfigError, check_run
from lightning_pd2bw.cli.model_profile import build_model_on_meta, sparsity_config
from lightning_pd2bw.cli.train import CONF, RECIPES, recipe_names, setup_hydra

from ..cli import run_cli

setup_hydra()
GROUP_OPTIONS = [(d.name, f.stem) for d in sorted(CONF.iterdir()) if d.is_dir() for f in sorted(d.glob("*.yaml"))]


def load(recipe: str = "tiny", overrides: tuple[str, ...] = ()):
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        return compose(config_name=recipe, overrides=[f"hydra.searchpath=[file://{CONF}]", *overrides])


def test_the_five_recipes_exist():
    assert {"tiny", "gpt13b", "gpt13b_sparse", "bert_base", "bert_large"} <= set(recipe_names())


@pytest.mark.parametrize("recipe", recipe_names())
def test_every_recipe_composes_and_passes_the_checks(recipe):
    required = list(load(recipe).requires)  # recipe=prune: init_from, refused by name without it
    if required:
        with pytest.raises(ConfigError, match=f"{required[0]} is required by this recipe"):
            check_run(load(recipe))
    cfg = load(recipe, tuple(f"{key}={RECIPES / 'tiny.yaml'}" for key in required))  # a path that exists
    model = build_model_on_meta(cfg)
    layout = check_run(cfg, num_layers=len(model.pipeline_layers()))
    assert layout.num_microbatches >= layout.num_stages
    assert layout.global_batch_size == layout.data_parallel_size * layout.num_microbatches * layout.micro_batch_size
    if sparsity_config(cfg) is not None:
        instantiate(sparsity_config(cfg))  # the callback accepts its arguments


def test_sparsity_none_switches_the_recipe_schedule_off():
    assert sparsity_config(load("tiny")).sparsity == 0.5
    assert sparsity_config(load("tiny", ("sparsity=none",))) is None


def test_gpt13b_recipe_is_gpt3_13b():
    cfg = load("gpt13b")
    config = instantiate(cfg.model.config)
    assert (config.n_layer, config.n_embd, config.n_head, config.block_size) == (40, 5120, 40, 2048)
    assert cfg.model.lr == 1e-4 and list(cfg.model.betas) == [0.9, 0.95] and cfg.model.weight_decay == 0.1
    assert cfg.trainer.gradient_clip_val == 1.0 and cfg.global_batch_size == 1024 and cfg.data.seq_len == 2048
    sparse = load("gpt13b_sparse")
    assert sparse.sparsity.sparsity == 0.75 and sparse.model == cfg.model


@pytest.mark.parametrize("recipe", ["tiny", "gpt13b_sparse"])
def test_sparse_recipes_prune_as_the_sweep_measured_best(recipe):
    """docs/sparsity.md's sweep at 75%: gradual pruning from 25% to 95% of training with one global threshold ended
    6.6% above dense on GPT small (25% to 90%: 7.3%; 25% to 75%: 10.6%; two seeds each)."""
    cfg = load(recipe)
    steps = cfg.trainer.max_steps
    assert cfg.sparsity._target_.endswith("GradualMagnitudeSparsity") and cfg.sparsity.allocation == "global"
    assert (cfg.sparsity.start_step, cfg.sparsity.end_step) == (int(steps * 0.25), int(steps * 0.95))


@pytest.mark.parametrize("group, option", GROUP_OPTIONS)
def test_every_group_option_composes(group, option):
    extra = ("data.seq_len=64",) if group == "model" else ()  # the shortest context among the presets
    prefix = "+" if group == "cluster" else ""  # pd2bw-plan's group, appended (cluster=NAME there)
    cfg = load("tiny", (f"{prefix}{group}={option}", *extra))
    if group in ("model", "data", "strategy"):
        check_run(cfg)
    node = cfg.get(group)
    if node and "_target_" in node and group in ("sparsity", "logger"):
        OmegaConf.to_container(node, resolve=True)


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.lrr=1", "lrr"),  # misspelt key
        ("trainer.max_steps=many", "max_steps"),  # wrong type
        ("sparsity.sparsity=dense", "sparsity"),
        ("model=gpt14b", "gpt14b"),  # unknown option
    ],
)
def test_bad_overrides_fail_at_compose_time_naming_the_key(override, message):
    with pytest.raises(ConfigCompositionException) as error:
        load("tiny", (override,))
    text = str(error.value) + str(error.value.__cause__)
    assert message in text


def test_a_typo_in_a_recipe_file_fails_against_the_schema(tmp_path):
    (tmp_path / "typo.yaml").write_text("defaults:\n  - config\n  - _self_\nmodel:\n  lrr: 1.0e-3\n")
    with initialize_config_dir(config_dir=str(tmp_path), version_base="1.3"):
        with pytest.raises(ConfigCompositionException) as error:
            compose(config_name="typo", overrides=[f"hydra.searchpath=[file://{CONF}]"])
    assert "Key 'lrr' not in 'ModelSchema'" in str(error.value) + str(error.value.__cause__)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ("trainer.devices=3", "strategy.num_stages=2"),
            "world size 3 (trainer.devices x trainer.num_nodes) is not a multiple of",
        ),
        (("global_batch_size=15",), "is not a multiple of micro_batch_size=4"),
        (("global_batch_size=4",), "1 microbatches per step < 2 stages"),
        (
            ("trainer.devices=4", "strategy.num_stages=2", "global_batch_size=15", "micro_batch_size=1"),
            "not divisible by the data-parallel width 2",
        ),
        (("strategy.num_microbatches=2",), "contradicts global_batch_size=16"),
        (("data.seq_len=4096",), "data.seq_len=4096 exceeds the model's context"),
        (("trainer.accumulate_grad_batches=2",), "trainer.accumulate_grad_batches must be 1"),
        (
            ("strategy.plan=auto", "strategy.num_stages=2"),
            "strategy.plan='auto' chooses num_stages and num_microbatches itself; leave both unset",
        ),
        (("strategy.plan=auto", "global_batch_size=15"), "must be a multiple of the world size 2"),
        (("strategy.lookahead=-1",), "strategy.lookahead=-1 is invalid; valid: an int >= 0"),
        # true, false or a count per stage: no schema type holds both, so PipelineOptions names it before launch
        (("strategy.recompute=maybe",), "strategy.recompute='maybe' is invalid; valid: true, false, or per stage"),
        (("strategy.recompute=[1,0,0]",), "strategy.recompute=[1, 0, 0] needs one entry per stage: 2 stages here"),
        (("strategy.mode=gpipe", "strategy.lookahead=1"), "strategy.lookahead=1 has no meaning under strategy.mode"),
        # single values no schema type refuses (issue 48): named before any process starts, not a ZeroDivisionError
        (("micro_batch_size=0",), "micro_batch_size=0 must be > 0"),
        (("data.seq_len=0",), "data.seq_len=0 must be > 0"),
        (("model.lr=-1",), "model.lr=-1.0 must be > 0"),
        (("model.weight_decay=-0.1",), "model.weight_decay=-0.1 must be >= 0"),
        (("trainer.max_steps=0",), "trainer.max_steps=0 must be >= 1 (or -1"),
        (("trainer.precision=64",), None),  # supported: float64 runs (its loss broadcast typed: test_loss_dtype.py)
        (("trainer.precision=16-mixed",), "trainer.precision='16-mixed' is not supported with strategy=pd2bw"),
        (("trainer.precision=bf16",), None),  # Lightning's short form of bf16-mixed: one rule (engine/precision.py)
        (("trainer.precision=bf16-true",), "supported: 32-true, bf16-mixed, 64-true"),
        (("+data.paths=[/nonexistent.txt]",), "data.paths: '/nonexistent.txt' is not a file"),
    ],
)
def test_cross_field_checks_say_how_to_fix(overrides, message):
    if message is None:
        check_run(load("tiny", overrides))
        return
    with pytest.raises(ConfigError) as error:
        check_run(load("tiny", overrides))
    assert message in str(error.value)


def test_data_files_that_are_not_text_are_refused_by_name(tmp_path):
    empty, binary, text = tmp_path / "empty.txt", tmp_path / "model.bin", tmp_path / "ok.txt"
    empty.write_text("  \n")
    binary.write_bytes(bytes(range(256)) * 8)
    text.write_text("héllo wörld " * 10_000)  # multi-byte characters across the 64 KiB read
    for path, message in ((empty, "is empty"), (binary, "is not UTF-8 text")):
        with pytest.raises(ConfigError, match=f"data.paths: '{path}' {message}"):
            check_run(load("tiny", (f"+data.paths=[{path}]",)))
    check_run(load("tiny", (f"+data.paths=[{text}]",)))


def test_more_stages_than_layers():
    cfg = load("tiny", ("trainer.devices=16", "strategy.num_stages=16", "global_batch_size=64"))
    with pytest.raises(ConfigError, match="has 10 pipeline layers but strategy.num_stages=16"):
        check_run(cfg, num_layers=len(build_model_on_meta(cfg).pipeline_layers()))


def test_layout_rules_are_one_set_named_in_each_callers_keys():
    """The engine's Layout, the strategy and the Hydra checks apply the same rule (engine/layout.py), each
    naming the settings as its users write them."""
    from lightning_pd2bw import PipeDream2BWStrategy
    from lightning_pd2bw.cli.checks import CONFIG_KEYS
    from lightning_pd2bw.engine.layout import Layout, check_microbatches

    messages = []
    for call in (
        lambda: Layout(num_stages=4, num_microbatches=2),
        lambda: PipeDream2BWStrategy(num_stages=4, num_microbatches=2),
        lambda: check_microbatches(4, 2, CONFIG_KEYS),
    ):
        with pytest.raises(ValueError) as error:
            call()
        messages.append(str(error.value))
    assert all("(2 microbatches per step < 4 stages): the pipeline would idle" in m for m in messages)
    assert messages[0].startswith("num_microbatches=2 is smaller than num_stages=4")
    assert messages[1].startswith("PipeDream2BWStrategy: num_microbatches=2 is smaller than num_stages=4")
    assert "is smaller than strategy.num_stages=4" in messages[2]


def test_schema_defaults_are_the_classes_defaults():
    """Every default lives in the class it configures; the schemas read it there (no second copy to drift)."""
    from lightning_pd2bw import PipeDream2BWStrategy
    from lightning_pd2bw.cli.schemas import DataSchema, ModelSchema, StrategySchema, TokensDataSchema, defaults_of
    from lightning_pd2bw.data import TextDataModule
    from lightning_pd2bw.data.tokens import TokenDataModule
    from lightning_pd2bw.models.base import PipelineLanguageModel

    for schema, cls in (
        (StrategySchema, PipeDream2BWStrategy),
        (DataSchema, TextDataModule),
        (TokensDataSchema, TokenDataModule),
        (ModelSchema, PipelineLanguageModel),
    ):
        own = defaults_of(cls)
        fields = schema.__dataclass_fields__
        shared = [k for k in fields if k in own and own[k] is not None and k != "batch_size"]
        assert len(shared) >= 4, (schema, shared)
        for key in shared:
            field = fields[key]
            value = field.default_factory() if callable(field.default_factory) else field.default
            assert value == (list(own[key]) if isinstance(own[key], tuple) else own[key]), (schema.__name__, key)


@pytest.mark.parametrize(
    "recipe, cluster, extra",
    [
        ("gpt13b", "a100_80g_8x1", ()),  # ~9 s: 8 GPUs, a recomputation count per stage
        pytest.param(  # ~20 s: the full tier
            "gpt13b",
            "a100_80g_8x8",
            ("strategy.lookahead=2", "strategy.delay_correction=error_feedback"),
            marks=pytest.mark.full,
        ),
    ],
)
def test_pd2bw_plan_plans_the_run_that_trains(recipe, cluster, extra):
    """pd2bw-plan's proposal, trained with its own "train it:" overrides, is the run the dry run (and plan="auto",
    through the same ``Candidate.of``) plans: the same stages, the same memory per stage to the byte, the same
    predicted time. Before 0.2.0, pd2bw-plan left out the default delay correction's buffers and the lookahead."""
    import shlex

    from lightning_pd2bw.cli.plan import cluster_of, search_plans, train_overrides
    from lightning_pd2bw.cli.run_plan import candidate_of, stage_plan
    from lightning_pd2bw.planner.cost import predict

    cluster = (f"+cluster={cluster}",)
    planned = load(recipe, cluster + extra)
    best = search_plans(planned, build_model_on_meta(planned))[0][0]
    assert best.candidate.delay_correction == planned.strategy.delay_correction is not None
    assert best.candidate.lookahead == planned.strategy.lookahead
    trained = load(recipe, cluster + extra + tuple(shlex.split(train_overrides(cluster_of(planned), best))))
    model = build_model_on_meta(trained)
    layout = check_run(trained, num_layers=len(model.pipeline_layers()))
    profile, stages, memories = stage_plan(trained, layout, model)
    assert [tuple(r) for r in stages] == [tuple(r) for r in best.stages]
    assert memories == list(best.stage_memory)
    assert candidate_of(trained, layout) == best.candidate
    again = predict(profile, candidate_of(trained, layout), cluster_of(trained), layout.global_batch_size, stages)
    assert again.batch_time == best.batch_time


def test_help_lists_what_users_type(tmp_path, monkeypatch, capsys):
    """Issue 49: ``--help`` names the recipes, each group's options as typed (``strategy=pd2bw_flush``, not
    ``strategy_schema``) and, for pd2bw-plan, the clusters it needs; not pd2bw-train's Hydra page."""
    import sys

    from lightning_pd2bw.cli import plan, train

    train_help = run_cli("--help", cwd=tmp_path)
    assert train_help.returncode == 0 and train_help.stdout.startswith("usage: pd2bw-train [recipe=NAME]")
    assert "strategy=pd2bw_2bw|pd2bw_flush" in train_help.stdout and "schema" not in train_help.stdout
    assert "gpt13b" in train_help.stdout and "logger=csv|wandb" in train_help.stdout
    # each recipe with what it trains and its mode (recipe=bert_tiny runs Flush: said before it is chosen)
    assert "  bert_tiny      A tiny BERT (masked LM) on the embedded corpus, PipeDream-Flush" in train_help.stdout
    monkeypatch.setattr(sys, "argv", ["pd2bw-plan", "--help"])
    plan.main()
    text = capsys.readouterr().out
    assert text.startswith("usage: pd2bw-plan [recipe=NAME] cluster=NAME") and "v100_16g_8x8" in text
    assert text != train_help.stdout and train.main is not plan.main


def test_a_second_run_into_a_running_runs_folder_is_refused(tmp_path):
    """Issue 48: two runs sharing one output folder would overwrite each other's summary, log and checkpoints; the
    second is refused before any process starts while the first is alive, and proceeds once it is gone (a restart)."""
    import json
    import os
    import socket
    import subprocess
    import sys

    from lightning_pd2bw.cli.train import RUN_LOCK, claim_output_dir

    out = tmp_path / "shared"
    out.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (out / RUN_LOCK).write_text(json.dumps({"host": socket.gethostname(), "pid": sleeper.pid}))
        done = run_cli("trainer.max_steps=1", f"paths.output_dir={out}", cwd=tmp_path)
        assert done.returncode != 0 and "output folder of a run still going" in done.stderr, done.stderr[-2000:]
        assert "paths.output_dir" in done.stderr
    finally:
        sleeper.kill()
        sleeper.wait()
    claim_output_dir(out)  # the owner is gone: a restarted job takes the folder over
    assert json.loads((out / RUN_LOCK).read_text())["pid"] == os.getpid()


@pytest.mark.parametrize(
    "env,override,offline",
    [
        ({}, (), True),
        ({"WANDB_MODE": "online"}, (), False),
        ({"WANDB_MODE": "offline"}, (), True),
        ({"WANDB_MODE": "disabled"}, (), True),
        ({"WANDB_OFFLINE": "false"}, (), False),
        ({"WANDB_MODE": "offline"}, ("logger.offline=false",), False),
    ],
)
def test_the_documented_wandb_switch_sets_the_loggers_mode(monkeypatch, tmp_path, env, override, offline):
    """docs/configuration.md: offline by default, ``WANDB_MODE=online`` (or ``WANDB_OFFLINE=false``) or
    ``logger.offline=false`` uploads. Read from the instantiated WandbLogger (nothing connects before its first
    log), not from the config."""
    pytest.importorskip("wandb")
    for name in ("WANDB_MODE", "WANDB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    setup_hydra()
    cfg = load("tiny", ("logger=wandb", f"paths.output_dir={tmp_path}", *override))
    logger = instantiate(cfg.logger)
    assert logger._offline is offline
