"""One options object (``engine/options.py``): the strategy, the Hydra checks and the engine build the same
``PipelineOptions``, so a rule and a default live in one place and each error names the option as its caller's users
write it."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
import torch.distributed as dist

from lightning_pd2bw import Layout, PipeDream2BWStrategy, PipelineEngine
from lightning_pd2bw.cli.checks import ConfigError, check_options
from lightning_pd2bw.engine.options import Clipping, PipelineOptions
from lightning_pd2bw.lightning.options import STRATEGY_KEYS, StrategyOptions

from ..distributed.launch import free_port


def flat_defaults() -> dict[str, object]:
    """Every option's flat key (what users type) and its default: the engine's ``PipelineOptions`` (its
    ``Clipping`` by its ``clip_mode``) and the strategy's own ``StrategyOptions``."""
    defaults = {}
    for options in (PipelineOptions, StrategyOptions):
        for option in dataclasses.fields(options):
            if option.name == "clipping":
                defaults["clip_mode"] = option.default.mode
            elif option.name != "keys":
                defaults[option.name] = option.default
    return defaults


def test_the_strategy_takes_every_option_with_the_options_default():
    signature = inspect.signature(PipeDream2BWStrategy.__init__).parameters
    for name, default in flat_defaults().items():
        assert name in signature, f"PipeDream2BWStrategy does not take {name}"
        assert signature[name].default == default, name


def test_options_by_layer_and_the_schema_walks_both():
    """Issue 61, 4: the engine's options hold the layout, the compute and the update (clipping as one value); the
    strategy's own (plan, batch, timeouts, checkpoints, requeue) live in ``lightning/`` and the engine never sees
    them; the Hydra schema is the flat union users type, each default the owner's."""
    from lightning_pd2bw.cli.schemas import StrategySchema

    assert set(StrategyOptions.names()).isdisjoint(PipelineOptions.names())
    assert set(StrategyOptions.names()) == {
        "plan",
        "global_batch_size",
        "failure_timeout",
        "hang_timeout",
        "async_checkpoint",
        "requeue",
    }
    schema = {f.name: f.default for f in dataclasses.fields(StrategySchema) if f.name != "_target_"}
    assert schema == flat_defaults()
    strategy = PipeDream2BWStrategy(clip_mode="stage", hang_timeout=30)
    assert strategy.options.clipping == Clipping(None, "norm", "stage")  # the value: the Trainer's, at setup
    assert strategy.strategy_options == StrategyOptions(hang_timeout=30)
    assert Clipping(1.0, "value").kind == "value" and Clipping(1.0).kind == "global" and Clipping().kind is None
    with pytest.raises(ValueError, match=r"Trainer\(gradient_clip_val=-1.0\) must be >= 0"):
        Clipping.of(STRATEGY_KEYS, value=-1.0)


def test_the_strategy_holds_its_options_and_reads_them_by_name():
    strategy = PipeDream2BWStrategy(num_stages=2, mode="flush", recompute=True, compile=True, lookahead=1)
    assert strategy.options == PipelineOptions(num_stages=2, mode="flush", recompute=True, compile={}, lookahead=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        strategy.options.mode = "2bw"
    with pytest.raises(AttributeError):  # one owner: strategy.options.mode, not a forwarded strategy.mode
        _ = strategy.mode


@pytest.mark.parametrize(
    "option, strategy_message, config_message",
    [
        (
            {"clip_mode": "all"},
            "PipeDream2BWStrategy(clip_mode='all') is invalid",
            "strategy.clip_mode='all' is invalid",
        ),
        ({"on_nonfinite": "x"}, "PipeDream2BWStrategy(on_nonfinite='x') is invalid", "strategy.on_nonfinite='x'"),
        ({"hang_timeout": 0}, "PipeDream2BWStrategy(hang_timeout=0) must be > 0", "strategy.hang_timeout=0 must be"),
        ({"boundary_dtype": "bf16"}, "(boundary_dtype='bf16') is invalid", "strategy.boundary_dtype='bf16' is invalid"),
        ({"compile": {"nope": 1}}, "PipeDream2BWStrategy(compile=...) has unknown", "strategy.compile has unknown"),
        ({"plan": "manual"}, "PipeDream2BWStrategy(plan='manual') is invalid", "strategy.plan='manual' is invalid"),
        ({"mode": "x"}, "PipeDream2BWStrategy: mode='x' is not a mode", "strategy.mode='x' is not a mode"),
        (
            {"shard_gradients": True, "shard_optimizer": False},
            "PipeDream2BWStrategy(shard_gradients=True) needs the optimizer sharded",
            "strategy.shard_gradients=True needs the optimizer sharded",
        ),
    ],
)
def test_one_rule_named_in_each_callers_words(option, strategy_message, config_message):
    with pytest.raises(ValueError) as error:
        PipeDream2BWStrategy(**option)
    assert strategy_message in str(error.value)
    with pytest.raises(ConfigError) as error:
        check_options({"_target_": "lightning_pd2bw.PipeDream2BWStrategy", **option})
    assert config_message in str(error.value)


def test_replace_checks_again():
    options = PipelineOptions(num_stages=2)
    assert options.replace(num_microbatches=4).num_microbatches == 4
    with pytest.raises(ValueError, match="num_microbatches=1 is smaller than num_stages=2"):
        options.replace(num_microbatches=1)


@pytest.fixture
def one_process():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_the_engine_takes_the_options_and_resolves_them_once(one_process):
    layers = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]

    def build(options):
        return PipelineEngine(layers, options, lambda b: b, lambda o, b: o.sum())

    engine = build(
        PipelineOptions(mode="flush", num_microbatches=2, recompute=True, clipping=Clipping(1.0, mode="stage"))
    )
    assert engine.options.recompute and engine.options.clipping.kind == "stage" and engine.executor is None
    assert engine.layout == Layout(1, 2, "flush")  # resolved on this world: depth 1, the microbatches given
    assert engine.options.boundary_dtype is None  # "auto" without Lightning's precision: each tensor's own dtype
    engine.close()
    assert build(PipelineOptions()).layout == Layout(1, 1, "2bw")  # the defaults: depth = world, m = depth
    with pytest.raises(TypeError, match="PipelineEngine takes PipelineOptions"):
        build(Layout(1, 2, "flush"))
    with pytest.raises(ValueError, match=r"Clipping\(mode='all'\) is invalid; valid: global, stage"):
        PipelineOptions(clipping=Clipping(mode="all"))
    with pytest.raises(ValueError, match=r"PipelineOptions\(clip_mode='all'\) is invalid"):
        PipelineOptions.from_mapping({"clip_mode": "all"})
    with pytest.raises(TypeError, match="clip_val"):  # the clipping is an option now, not an engine keyword
        PipelineEngine(layers, PipelineOptions(), lambda b: b, lambda o, b: o.sum(), clip_val=1.0)


def test_one_default_correction_everywhere():
    """The Python constructor, Trainer(strategy="pd2bw") (the registry's constructor), pd2bw-train's composed
    config and the engine all run 2BW with the same delay correction unless told otherwise (issue 33)."""
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_pd2bw.engine.options import DEFAULT_CORRECTION

    from .test_config import load

    assert DEFAULT_CORRECTION == "predictive_error_feedback"  # the best measured: docs/quality.md
    assert PipeDream2BWStrategy().options.delay_correction == DEFAULT_CORRECTION
    assert StrategyRegistry.get("pd2bw").options.delay_correction == DEFAULT_CORRECTION
    assert PipelineOptions().delay_correction == DEFAULT_CORRECTION  # what PipelineEngine takes
    for recipe in ("tiny", "gpt13b", "bert_base"):
        assert load(recipe).strategy.delay_correction == DEFAULT_CORRECTION, recipe
    assert PipeDream2BWStrategy(delay_correction=None).options.delay_correction is None


def test_2bw_at_depth_one_over_several_processes_is_refused_with_the_fix():
    """Issue 46, 4: 2BW with one stage and several replicas is data parallelism paying the delay and a second weight
    version for nothing; every reader of the run refuses it by name (the planner never offers it)."""
    from lightning_pd2bw.cli.checks import check_run
    from lightning_pd2bw.planner.search import candidates

    from .test_config import load

    with pytest.raises(ValueError, match=r"mode='2bw' with num_stages=1 on 2 processes .* use mode='flush'"):
        PipelineOptions(num_stages=1).resolve(2)
    assert PipelineOptions(num_stages=1, mode="flush").resolve(2).num_stages == 1
    assert PipelineOptions().resolve(1).num_stages == 1  # one process: nothing else to run
    assert PipelineOptions(num_stages=2).layout(4) == PipelineOptions(num_stages=2).resolve(4).layout == Layout(2, 2)
    with pytest.raises(ConfigError, match=r"strategy.mode='2bw' with strategy.num_stages=1 on 2 processes"):
        check_run(load("tiny", ("strategy.num_stages=1",)))
    depths = {c.depth for c in candidates(8, 10, 64, PipelineOptions())}
    assert 1 not in depths and depths == {2, 4, 8}
    assert 1 in {c.depth for c in candidates(8, 10, 64, PipelineOptions(mode="flush"))}


def test_the_mode_is_a_value_with_its_facts():
    """``Layout.mode`` is a ``Mode``: equal to its string, printed as it, and the one place each part reads what the
    mode implies (two versions, a flush per batch, all forwards first)."""
    from lightning_pd2bw.engine.layout import Layout, Mode

    assert Layout(2, 2, "flush").mode is Mode.FLUSH and Layout(2, 2).mode == "2bw"
    assert f"{Mode.PD2BW}" == str(Mode.PD2BW) == "2bw" and repr(Mode.GPIPE) == "'gpipe'"
    facts = {
        mode.value: (mode.double_buffered, mode.flushes, mode.forwards_first, mode.splits_backward) for mode in Mode
    }
    assert facts == {
        "2bw": (True, False, False, False),
        "flush": (False, True, False, False),
        "gpipe": (False, True, True, False),
        "zb_h1": (False, True, False, True),
        "interleaved": (False, True, False, False),
    }
    assert all(mode.runs for mode in Mode) and [mode for mode in Mode if mode.interleaved] == [Mode.INTERLEAVED]
    with pytest.raises(ValueError, match="is not a mode"):
        Layout(2, 2, "1f1b")


def test_a_synchronous_start_is_a_count_of_steps():
    assert PipelineOptions(sync_steps=250).sync_steps == 250
    for bad in (-1, 2.5):
        with pytest.raises(ValueError, match=r"sync_steps=.* must be an integer >= 0"):
            PipelineOptions(sync_steps=bad)
