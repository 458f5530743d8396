"""Sparsity callbacks on one process with the real Trainer: exact zeros in weights and optimizer state,
hand-computed updates for grown and re-densified weights, resume, logging, export, bad input."""

from __future__ import annotations

import csv

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.nn.utils import prune
from torch.utils.data import DataLoader

from lightning_pd2bw.data import LMDataset, read_corpus
from lightning_pd2bw.models import GPT, GPTConfig
from lightning_pd2bw.sparsity import (
    GradualMagnitudeSparsity,
    MaskUpdate,
    RigL,
    Sparsifier,
    StaticSparsity,
    checkpoint_masks,
    fold_masks,
    select_targets,
)

SEQ = 16


def model(**optim) -> GPT:
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=SEQ), **({"lr": 1e-2} | optim))


def loader() -> DataLoader:
    return DataLoader(LMDataset(read_corpus(max_bytes=30_000), SEQ), batch_size=4, shuffle=False, drop_last=True)


def fit(module, callbacks, steps, ckpt_path=None, **trainer_kwargs) -> pl.Trainer:
    torch.manual_seed(0)
    kwargs = dict(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=1,
    )
    trainer = pl.Trainer(callbacks=callbacks, **(kwargs | trainer_kwargs))
    trainer.fit(module, loader(), ckpt_path=ckpt_path)
    return trainer


class ZeroChecker(Callback):
    """After every batch: masked weights and every optimizer-state tensor of their shape are exactly zero."""

    def __init__(self, sparsity) -> None:
        self.sparsity, self.checked = sparsity, 0

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        sparsifier = self.sparsity.sparsifier
        assert sparsifier.masks, "masks exist from the first step on"
        for name, mask in sparsifier.masks.items():
            param = sparsifier.local[name]
            assert torch.count_nonzero(param.detach()[~mask]) == 0, name
            state = [v for v in trainer.optimizers[0].state[param].values() if torch.is_tensor(v) and v.dim()]
            for value in state:
                assert torch.count_nonzero(value[~mask]) == 0, f"optimizer state of {name}"
            self.checked += 1


@pytest.mark.parametrize(
    "optimizer, precision, accumulate",
    [("adamw", "32-true", 1), ("adamw", "bf16-true", 1), ("sgd", "32-true", 2), ("adamw", "32-true", 2)],
)
def test_masked_weights_and_optimizer_state_stay_zero(optimizer, precision, accumulate):
    sparsity = GradualMagnitudeSparsity(0.75, start_step=0, end_step=6, update_interval=2, allocation="erk")
    checker = ZeroChecker(sparsity)
    module = model(optimizer=optimizer, momentum=0.9, weight_decay=0.1)
    fit(module, [sparsity, checker], 8, precision=precision, accumulate_grad_batches=accumulate)
    assert checker.checked > 0 and sparsity.step == 8
    measured = sparsity.sparsifier.measure()
    assert measured["overall_density"] == pytest.approx(0.25, abs=2e-3)
    if precision == "bf16-true":
        assert next(iter(sparsity.sparsifier.local.values())).dtype == torch.bfloat16


class GrowthRecorder(Callback):
    """Records, at RigL update steps, the masks before and after the change and the gradients."""

    def __init__(self, sparsity) -> None:
        self.sparsity, self.previous, self.records = sparsity, None, []

    def on_train_batch_start(self, *args) -> None:
        self.previous = {n: m.clone() for n, m in self.sparsity.sparsifier.masks.items()}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        sparsifier = self.sparsity.sparsifier
        grown = {n: m & ~self.previous[n] for n, m in sparsifier.masks.items()}
        if any(g.any() for g in grown.values()):
            grads = {n: sparsifier.local[n].grad.clone() for n in grown}
            before = {n: sparsifier.local[n].detach()[grown[n]].clone() for n in grown}
            self.records.append((grown, grads, before, optimizer.param_groups[0]["lr"]))

    def on_train_batch_end(self, *args) -> None:
        if self.records and len(self.records[-1]) == 4:
            grown, grads, before, lr = self.records[-1]
            params = self.sparsity.sparsifier.local
            self.records[-1] = (grown, grads, before, lr, {n: params[n].detach()[grown[n]].clone() for n in grown})


def test_rigl_grown_weights_start_at_zero_with_zero_state():
    """SGD with momentum 0.9 and no weight decay: a weight grown at step k is 0 with a zero momentum
    buffer, so after the step it is exactly -lr * grad (hand-computed)."""
    sparsity = RigL(0.5, end_step=10, update_interval=3, drop_fraction=0.3, allocation="uniform")
    recorder = GrowthRecorder(sparsity)
    fit(model(optimizer="sgd", momentum=0.9, weight_decay=0.0), [sparsity, recorder], 8)
    assert len(recorder.records) == 2  # updates at steps 3 and 6
    for grown, grads, before, lr, after in recorder.records:
        for name, positions in grown.items():
            assert torch.count_nonzero(before[name]) == 0
            torch.testing.assert_close(after[name], -lr * grads[name][positions], rtol=0, atol=0)
    assert sparsity.sparsifier.measure()["overall_density"] == pytest.approx(0.5, abs=1e-3)


def test_sparse_to_dense_regrows_from_zero_with_rewarmed_learning_rate():
    """Plain SGD: at the dense step K every weight moves by -lr * (1/W) * grad, pruned ones from 0."""
    sparsity = StaticSparsity(0.5, init="magnitude", dense_from_step=3, rewarmup_steps=4)

    class Check(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if sparsity.step == 3:
                self.lr = pl_module.hparams.lr  # the configured rate; the callback scales it inside step()
                self.params = {n: p.detach().clone() for n, p in sparsity.sparsifier.local.items()}
                self.grads = {n: p.grad.clone() for n, p in sparsity.sparsifier.local.items()}

        def on_train_batch_end(self, trainer, *args):
            if sparsity.step == 4:
                for name, param in sparsity.sparsifier.local.items():
                    expected = self.params[name] - self.lr * 0.25 * self.grads[name]
                    torch.testing.assert_close(param.detach(), expected, rtol=1e-6, atol=1e-7)
                self.done = True

    check = Check()
    module = model(optimizer="sgd", momentum=0.0, weight_decay=0.0)
    fit(module, [sparsity, check], 6)
    assert check.done and not sparsity.sparsifier.masks
    assert any((check.params[n] == 0).float().mean() > 0.45 for n in check.params), "weights were pruned before K"
    assert sparsity.sparsifier.measure()["overall_density"] > 0.99


def test_the_dense_phase_runs_its_own_learning_rate_schedule():
    """``dense_lr=0.5`` with ``dense_from_step=3`` of 6 steps, plain SGD under a warm-up + cosine schedule: at step k
    >= 3 each weight moves by ``-lr_k * grad`` with ``lr_k = 0.5 * peak * (0.1 + 0.9 * (1 + cos(pi (k - 3) / 3)) / 2)``
    times the re-warm-up ``min(1, (k - 2) / 2)``, whatever the run's own schedule says there (by hand: steps 3, 4,
    5 at 0.25, 0.3875 and 0.1625 of the peak)."""
    sparsity = StaticSparsity(0.5, init="magnitude", dense_from_step=3, rewarmup_steps=2, dense_lr=0.5)
    peak = 1e-2

    class Check(Callback):
        moved: dict[int, float] = {}

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.params = {n: p.detach().clone() for n, p in sparsity.sparsifier.local.items()}
            self.grads = {n: p.grad.clone() for n, p in sparsity.sparsifier.local.items()}
            self.step = sparsity.step

        def on_train_batch_end(self, trainer, *args):
            if self.step >= 3:
                name = next(iter(self.params))
                grad = self.grads[name]
                delta = sparsity.sparsifier.local[name].detach() - self.params[name]
                self.moved[self.step] = float(-(delta * grad).sum() / (grad * grad).sum()) / peak

    check = Check()
    fit(
        model(optimizer="sgd", momentum=0.0, weight_decay=0.0, lr=peak, warmup_steps=1, max_steps=6),
        [sparsity, check],
        6,
    )
    assert sorted(check.moved) == [3, 4, 5]
    for step, expected in ((3, 0.25), (4, 0.3875), (5, 0.1625)):
        assert check.moved[step] == pytest.approx(expected, rel=1e-4), step
    with pytest.raises(ValueError, match=r"dense_lr=0.5, dense_from_step=None.*needs dense_from_step"):
        StaticSparsity(0.5, dense_lr=0.5)


def test_density_scaling_is_supars_initialisation_and_adams_rate():
    """``density_scaling=True`` at 75% (density 1/4): the masked layers start at 2x the weights the unscaled run
    starts from (1/sqrt(1/4)), and AdamW's first step (without decay: lr x sign(grad) for every gradient far above
    eps) moves them by 4 x lr (1/density); the other parameters by lr, as without scaling."""
    lr = 1e-3

    class First(Callback):
        def on_train_start(self, trainer, pl_module):
            self.start = {n: p.detach().clone() for n, p in pl_module.named_parameters()}

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.grads = {n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None}

        def on_train_batch_end(self, trainer, pl_module, *args):
            self.moved = {n: p.detach() - self.start[n] for n, p in pl_module.named_parameters()}

    runs = {}
    for scaling in (False, True):
        sparsity, first = StaticSparsity(0.75, seed=3, density_scaling=scaling), First()
        fit(model(lr=lr, weight_decay=0.0), [sparsity, first], 1)
        runs[scaling] = first, sorted(sparsity.sparsifier.masks)
    (plain, targets), (scaled, _) = runs[False], runs[True]
    for name in plain.start:
        factor = 2.0 if name in targets else 1.0
        torch.testing.assert_close(scaled.start[name], factor * plain.start[name], rtol=0, atol=0)
        grad = scaled.grads.get(name)
        if grad is None:
            continue
        clear = grad.abs() > 1e-4  # Adam's first step: lr x g / (|g| + 1e-8), lr x sign(g) to 1e-4 here
        rate = 4 * lr if name in targets else lr
        torch.testing.assert_close(scaled.moved[name][clear], -rate * grad[clear].sign(), rtol=1e-3, atol=0)
    with pytest.raises(ValueError, match="density_scaling=True.*needs a mask of constant"):
        GradualMagnitudeSparsity(0.75, end_step=10, density_scaling=True)


def test_static_random_masks_are_fixed_and_reproducible():
    first, second = StaticSparsity(0.75, seed=3), StaticSparsity(0.75, seed=3)
    fit(model(), [first], 1)
    initial = {n: m.clone() for n, m in first.sparsifier.masks.items()}
    fit(model(), [second], 5)
    for name, mask in initial.items():
        assert torch.equal(second.sparsifier.masks[name], mask)
        assert int(mask.sum()) == round(0.25 * mask.numel())


def test_resume_gives_the_uninterrupted_masks_and_weights(tmp_path):
    def run(callbacks, ckpt_path=None):
        module = model()
        fit(
            module,
            callbacks,
            6,
            limit_train_batches=3,
            ckpt_path=ckpt_path,
            enable_checkpointing=True,
            default_root_dir=tmp_path,
        )
        return module

    sparsity = GradualMagnitudeSparsity(0.7, start_step=1, end_step=5, update_interval=1)
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1)
    full = run([sparsity, checkpoints])
    resumed_sparsity = GradualMagnitudeSparsity(0.7, start_step=1, end_step=5, update_interval=1)
    resumed = run([resumed_sparsity], ckpt_path=str(tmp_path / "epoch=0-step=3.ckpt"))
    assert resumed_sparsity.step == sparsity.step == 6
    for name, mask in sparsity.sparsifier.masks.items():
        assert torch.equal(resumed_sparsity.sparsifier.masks[name], mask)
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_logs_density_churn_and_flops(tmp_path):
    sparsity = GradualMagnitudeSparsity(0.5, start_step=0, end_step=4, update_interval=2)
    module = model()
    fit(module, [sparsity], 6, logger=CSVLogger(tmp_path, name="run"))
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    last = [r for r in rows if r.get("sparsity/density")][-1]
    assert float(last["sparsity/density"]) == pytest.approx(0.5, abs=1e-3)
    assert float(last["sparsity/target_density"]) == pytest.approx(0.5)
    layer = "sparsity/density/layers.1.fc.weight"
    assert float(last[layer]) == pytest.approx(0.5, abs=1e-2)
    churn = [float(r["sparsity/churn"]) for r in rows if r.get("sparsity/churn")]
    assert max(churn) > 0 and churn[-1] == 0, "churn is reported on update steps, zero between them"
    numel = sum(p.numel() for p in sparsity.sparsifier.local.values())
    expected = 1 - 6 * 0.5 * numel / module.flops_per_token()
    assert float(last["sparsity/flops_ratio"]) == pytest.approx(expected, rel=1e-3)


def test_the_final_sparsity_is_measured_after_the_last_mask_change(tmp_path):
    """The last log (every 4 steps: step 4) precedes the last pruning update (step 5); the values a run's summary
    reads (``callback_metrics``) and the logger's last row are measured at the end, after it."""
    sparsity = GradualMagnitudeSparsity(0.5, start_step=0, end_step=5, update_interval=2)
    trainer = fit(model(), [sparsity], 6, logger=CSVLogger(tmp_path, name="run"), log_every_n_steps=4)
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    logged = [float(r["sparsity/density"]) for r in rows if r.get("sparsity/density")]
    assert logged[-1] == pytest.approx(0.5, abs=1e-3)
    assert logged[0] > 0.5 + 1e-3, "the log at step 4 saw the masks before the last update"
    assert float(trainer.callback_metrics["sparsity/density"]) == pytest.approx(0.5, abs=1e-3)
    assert float(trainer.callback_metrics["sparsity/target_density"]) == pytest.approx(0.5)


def test_export_folds_masks_into_plain_weights(tmp_path):
    sparsity = StaticSparsity(0.6, init="magnitude")
    module = model()
    trainer = fit(module, [sparsity], 3, enable_checkpointing=True, default_root_dir=tmp_path)
    path = tmp_path / "final.ckpt"
    trainer.save_checkpoint(path)
    masks = checkpoint_masks(path)
    assert set(masks) == set(sparsity.sparsifier.masks)
    plain = model()
    plain.configure_model()
    plain.load_state_dict(torch.load(path, weights_only=False)["state_dict"])
    zeros = fold_masks(plain, masks)
    assert zeros == sum(int((~m).sum()) for m in masks.values())
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in plain.modules())


def test_export_removes_torch_prune_reparametrisation():
    layer = nn.Sequential(nn.Linear(8, 8))
    prune.l1_unstructured(layer[0], "weight", amount=0.5)
    fold_masks(layer)
    assert not hasattr(layer[0], "weight_orig") and not layer[0]._forward_pre_hooks
    assert int((layer[0].weight == 0).sum()) == 32 and isinstance(layer[0].weight, nn.Parameter)


def test_global_threshold_floor_keeps_every_layer_alive():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))
    with torch.no_grad():
        net[1].weight.mul_(1e-4)  # one global threshold would remove this whole layer
    Sparsifier(select_targets(net), "global", min_layer_density=0.0).update(1, MaskUpdate("magnitude", density=0.4))
    assert torch.count_nonzero(net[1].weight) == 1  # without the floor, only the one-weight minimum survives
    net[1].weight.data.normal_().mul_(1e-4)
    Sparsifier(select_targets(net), "global", min_layer_density=0.1).update(1, MaskUpdate("magnitude", density=0.4))
    assert torch.count_nonzero(net[1].weight) == round(0.1 * 1024)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: StaticSparsity(1.0), "sparsity=1.0 must be in [0.0, 1.0)"),
        (lambda: GradualMagnitudeSparsity(0.5, end_step=5, start_step=5), "need 0 <= start_step < end_step"),
        (lambda: StaticSparsity(0.5, allocation="erdos"), "allocation='erdos' is not valid; valid: uniform, erk"),
        (lambda: StaticSparsity(0.5, allocation="global"), "init='magnitude', or allocation='uniform'"),
        (lambda: RigL(0.5, end_step=10, drop_fraction=1.5), "drop_fraction=1.5 must be in"),
        (lambda: StaticSparsity(0.5, dense_from_step=0), "dense_from_step=0) must be >= 1"),
        (lambda: select_targets(model(), targets=[r"nothing\.here"]), "match no parameter of GPT"),
    ],
)
def test_bad_sparsity_arguments_name_the_key_and_the_fix(make, message):
    with pytest.raises(ValueError, match=None) as error:
        make()
    assert message in str(error.value)
