"""The Lightning internals ``compat.py`` relies on still behave as it assumes."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_pd2bw.compat import place_module


class TwoLayers(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))


def test_place_module_tells_lightning_the_device():
    """``pl_module.device`` follows the stage's device (a plain ``_apply`` leaves it at the CPU it was built on:
    on a GPU rank, callbacks then all-gather CPU tensors over NCCL)."""
    module = TwoLayers()
    module.layers[1].to("meta")  # another stage's layer
    place_module(module, torch.device("cpu"))
    assert module.device == torch.device("cpu")
    assert module.layers[0].weight.device.type == "cpu" and module.layers[1].weight.is_meta
    place_module(module, torch.device("meta"))  # any device other than the one it was built on
    assert module.device == torch.device("meta")


def test_a_plain_apply_does_not_update_lightnings_device():
    """Why ``place_module`` exists: if this starts failing, Lightning tracks ``_apply`` and the helper can go."""
    module = TwoLayers()
    module._apply(lambda t: t.to("meta"))
    assert module.device == torch.device("cpu")


def test_sigterm_internals_exist():
    """``preemption.py`` replaces the epoch loop's per-step SIGTERM broadcast and sets the connector's flag."""
    import signal

    from lightning_pd2bw.compat import mark_sigterm_received, replace_sigterm_check, sigterm_handler_before_lightning

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    calls = []
    replace_sigterm_check(trainer, lambda: calls.append(1))
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor()
    assert calls == [1]
    assert not trainer.received_sigterm
    mark_sigterm_received(trainer)
    assert trainer.received_sigterm
    before = signal.getsignal(signal.SIGTERM)
    trainer._signal_connector.register_signal_handlers()
    try:
        assert signal.getsignal(signal.SIGTERM) is not before  # Lightning's own handler is in place
        assert sigterm_handler_before_lightning(trainer) is before
    finally:
        trainer._signal_connector.teardown()


def test_fit_loop_internals_exist():
    """The fit loop's attributes ``compat`` reads or sets are still there (a rename fails here, not silently)."""
    import inspect

    from lightning.pytorch.loops.fit_loop import _FitLoop

    from lightning_pd2bw.compat import combined_train_loader, skip_lightning_backward

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    assert combined_train_loader(trainer) is None  # built when fit starts
    assert hasattr(trainer.fit_loop, "_data_source")
    # a property that reaches the automatic optimization (a plain attribute would be set and ignored)
    assert isinstance(inspect.getattr_static(_FitLoop, "_skip_backward"), property)
    skip_lightning_backward(trainer)
    assert trainer.fit_loop.epoch_loop.automatic_optimization._skip_backward is True


def test_lightnings_helpers_keep_the_signatures_the_strategy_calls():
    """The private helpers re-exported from ``compat`` (the strategy's process group, launcher, collectives and
    teardown): a Lightning upgrade that renames a parameter fails here, not in a launched job."""
    import inspect

    from lightning_pd2bw import compat

    expected = {
        "init_process_group": (
            "cluster_environment",
            "torch_distributed_backend",
            "kwargs",
        ),  # timeout, store: to torch
        "default_backend_for_device": ("device",),
        "reduce_if_distributed": ("result", "group", "reduce_op"),
        "all_gather_if_distributed": ("tensor", "group", "sync_grads"),
        "optimizers_to_device": ("optimizers", "device"),
        "SubprocessScriptLauncher": ("cluster_environment", "num_processes", "num_nodes"),
    }
    for name, parameters in expected.items():
        found = inspect.signature(getattr(compat, name)).parameters
        assert all(p in found for p in parameters), f"compat.{name}: {list(found)}"
    assert compat.default_backend_for_device(torch.device("cpu")) == "gloo"


def test_before_optimizer_step_hooks_run_the_callbacks_then_the_module():
    from lightning_pd2bw.compat import before_optimizer_step_hooks

    calls = []

    class Record(pl.Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer):
            calls.append(("callback", optimizer))

    class Module(TwoLayers):
        def on_before_optimizer_step(self, optimizer):
            calls.append(("module", optimizer))

    trainer = pl.Trainer(callbacks=[Record()], accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    module = Module()
    trainer.strategy.connect(module)
    module.trainer = trainer
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    before_optimizer_step_hooks(trainer, optimizer)
    assert calls == [("callback", optimizer), ("module", optimizer)]


def test_only_compat_imports_lightnings_private_names():
    """Every ``from lightning... import _name`` of the package is in ``compat.py`` (one place to update)."""
    import ast
    from pathlib import Path

    import lightning_pd2bw

    package = Path(lightning_pd2bw.__file__).parent
    found = []
    for file in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "lightning":
                private = [alias.name for alias in node.names if alias.name.startswith("_")]
                if private or "._" in (node.module or "") or (node.module or "").endswith(".call"):
                    found.append(f"{file.relative_to(package)}: {node.module} {private}")
    assert found and all(line.startswith("compat.py:") for line in found), found
