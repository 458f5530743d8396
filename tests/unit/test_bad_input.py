"""Bad input fails before any process group starts, naming the key and the fix."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

import lightning_pd2bw
from lightning_pd2bw import PipeDream2BWStrategy
from lightning_pd2bw.engine.comm.grid import ProcessGrid
from lightning_pd2bw.engine.layout import Layout, width_of
from lightning_pd2bw.lightning import checks
from lightning_pd2bw.lightning.strategy import pipeline_layers_of


def test_registered_name_resolves():
    trainer = pl.Trainer(strategy="pd2bw", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, lightning_pd2bw.PipeDream2BWStrategy)
    assert trainer.strategy.options.mode == "2bw"


def test_fewer_microbatches_than_stages():
    with pytest.raises(ValueError, match="num_microbatches=2 is smaller than num_stages=4"):
        PipeDream2BWStrategy(num_stages=4, num_microbatches=2)


def test_unknown_mode_and_clip_mode():
    with pytest.raises(
        ValueError, match=r"PipeDream2BWStrategy: mode='pipedream' is not a mode; valid: 2bw, flush, gpipe"
    ):
        PipeDream2BWStrategy(mode="pipedream")
    with pytest.raises(ValueError, match=r"clip_mode='all'\) is invalid; valid: global, stage"):
        PipeDream2BWStrategy(clip_mode="all")


def test_lookahead_is_checked_where_it_is_given():
    with pytest.raises(ValueError, match=r"PipeDream2BWStrategy: lookahead=-1 is invalid; valid: an int >= 0"):
        PipeDream2BWStrategy(lookahead=-1)
    with pytest.raises(ValueError, match=r"lookahead=1.5 is invalid"):
        PipeDream2BWStrategy(lookahead=1.5)
    with pytest.raises(ValueError, match=r"lookahead=2 has no meaning under mode='gpipe'.* use mode='2bw' or 'flush'"):
        PipeDream2BWStrategy(mode="gpipe", lookahead=2)
    with pytest.raises(ValueError, match=r"lookahead=True is invalid"):
        Layout(2, 4, lookahead=True)
    assert Layout(2, 4, "2bw", lookahead=1).lookahead == 1 and PipeDream2BWStrategy(lookahead=1).options.lookahead == 1


def test_world_size_not_divisible_by_depth():
    with pytest.raises(ValueError, match="world size 6 .* is not a multiple of num_stages=4"):
        width_of(6, 4)
    grid = ProcessGrid(rank=5, world_size=6, num_stages=3)
    assert (grid.stage, grid.replica, grid.pipeline_ranks(), grid.replica_ranks()) == (2, 1, [3, 4, 5], [2, 5])


def test_fp16_is_refused_before_launch():
    from lightning.pytorch.plugins.precision import MixedPrecision

    # on a CPU Lightning itself swaps 16-mixed for bf16; the strategy's check runs when the launcher is configured
    strategy = PipeDream2BWStrategy(num_stages=2, precision_plugin=MixedPrecision("16-mixed", device="cuda"))
    with pytest.raises(ValueError, match="precision='16-mixed' is not supported by strategy='pd2bw'.*bf16-mixed"):
        checks.check_precision(strategy.precision_plugin)


def test_module_without_contract():
    class Plain(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(2, 2)

    with pytest.raises(TypeError, match="missing pipeline_layers .*pipeline_inputs, pipeline_loss"):
        pipeline_layers_of(Plain())


def test_sequential_layers_attribute_serves_as_pipeline_layers():
    class Seq(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))

        def pipeline_inputs(self, batch):
            return batch

        def pipeline_loss(self, output, batch):
            return output.sum()

    assert len(pipeline_layers_of(Seq())) == 2


def test_sequence_longer_than_context():
    from lightning_pd2bw.models import GPT, GPTConfig

    model = GPT(GPTConfig.from_name("tiny"))
    with pytest.raises(ValueError, match="sequence length 65 exceeds the model's block_size=64"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_reliability_arguments():
    with pytest.raises(ValueError, match=r"on_nonfinite='ignore'\) is invalid; valid: stop, skip"):
        PipeDream2BWStrategy(on_nonfinite="ignore")
    with pytest.raises(ValueError, match=r"failure_timeout=0\) must be > 0 seconds, or None"):
        PipeDream2BWStrategy(failure_timeout=0)
    with pytest.raises(ValueError, match=r"hang_timeout=-1\) must be > 0 seconds, or None"):
        PipeDream2BWStrategy(hang_timeout=-1)


def test_hydra_strategy_keys_reach_the_strategy():
    from hydra.utils import instantiate

    from tests.unit.test_config import load

    overrides = ("strategy.on_nonfinite=skip", "strategy.failure_timeout=30", "strategy.hang_timeout=null")
    cfg = load("tiny", (*overrides, "strategy.lookahead=1"))
    strategy = instantiate(cfg.strategy, num_stages=2, num_microbatches=2)
    settings = strategy.strategy_options
    assert (strategy.options.on_nonfinite, settings.failure_timeout, settings.hang_timeout) == ("skip", 30, None)
    assert strategy.options.lookahead == 1
    default = instantiate(load("tiny", ()).strategy, num_stages=2, num_microbatches=2)
    assert default.strategy_options.hang_timeout == 600


def test_horizon_changes_names_each_changed_setting():
    from lightning_pd2bw.lightning.checkpoints import horizon_changes

    saved = {"trainer.max_steps": 300, "model.max_steps": 300, "model.warmup_steps": 20}
    current = {"trainer.max_steps": 600, "model.max_steps": 600, "model.warmup_steps": 20, "new": 1}
    assert horizon_changes(saved, current) == "trainer.max_steps 300 -> 600, model.max_steps 300 -> 600"
    assert horizon_changes(saved, saved) == ""
