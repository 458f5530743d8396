"""The Lightning internals ``lightning/compat.py`` relies on still behave as it assumes."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_pd2bw.lightning.compat import place_module


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
    """``lightning/preemption.py`` replaces the epoch loop's per-step SIGTERM broadcast and sets the connector's flag."""
    import signal

    from lightning_pd2bw.lightning.compat import (
        mark_sigterm_received,
        replace_sigterm_check,
        sigterm_handler_before_lightning,
    )

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

    from lightning_pd2bw.lightning.compat import combined_train_loader, skip_lightning_backward

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

    from lightning_pd2bw.lightning import compat

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
    from lightning_pd2bw.lightning.compat import before_optimizer_step_hooks

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
    """Every ``from lightning... import _name`` of the package is in ``lightning/compat.py`` (one place to update)."""
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
    assert found and all(line.startswith("lightning/compat.py:") for line in found), found


def _imports_of(file) -> list[str]:
    import ast

    found = []
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.append(node.module or "")
    return found


def test_the_engine_imports_no_lightning():
    """Nothing under ``engine/``, ``observe/`` or ``checkpoint/`` nor the plain model core imports Lightning, even lazily; the
    distributed test ``test_engine.py`` trains with Lightning made unimportable."""
    from pathlib import Path

    import lightning_pd2bw

    package = Path(lightning_pd2bw.__file__).parent
    files = [*(f for d in ("engine", "observe", "checkpoint") for f in sorted((package / d).rglob("*.py")))]
    files.append(package / "models" / "core.py")
    found = [
        f"{file.relative_to(package)}: {name}"
        for file in files
        for name in _imports_of(file)
        if name.split(".")[0] in ("lightning", "pytorch_lightning", "lightning_fabric")
    ]
    assert len(files) > 15 and found == []


def test_torchs_optimizer_hook_internals_behave_as_torch_compat_assumes():
    """``engine/torch_compat.py`` swaps torch's private hook dicts: they exist, ``step()`` calls them, and
    suspending them skips them while ``run_post_hooks`` runs the post-hooks with step()'s arguments."""
    from collections import OrderedDict

    from lightning_pd2bw.engine.torch_compat import optimizer_hooks_suspended, run_post_hooks

    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.1)
    assert isinstance(optimizer._optimizer_step_pre_hooks, OrderedDict)
    assert isinstance(optimizer._optimizer_step_post_hooks, OrderedDict)
    calls = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: calls.append(("pre", args, kwargs)))
    optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append(("post", args, kwargs)))
    param.grad = torch.ones(2)
    optimizer.step()
    assert [c[0] for c in calls] == ["pre", "post"]
    by_step = calls[1]  # what step() hands its post-hooks
    calls.clear()
    with optimizer_hooks_suspended(optimizer, pre=True, post=True):
        optimizer.step()
    assert calls == []
    with optimizer_hooks_suspended(optimizer, pre=False, post=True):
        optimizer.step()
    run_post_hooks(optimizer)
    assert [c[0] for c in calls] == ["pre", "post"] and calls[1] == by_step
    assert torch.allclose(param.detach(), torch.full((2,), 0.7))  # three steps of 0.1
