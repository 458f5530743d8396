"""``benchmarks/convergence.py``'s arithmetic (time to quality, wall-clock from the logged rates) and
``benchmarks/convergence_settings.py``'s sweep suffixes and sweeps."""

from __future__ import annotations

import argparse

import pytest
import yaml

from benchmarks.convergence import (
    ROOT,
    curve,
    finished,
    flops_ratio,
    horizon_to,
    seconds,
    seeds,
    table,
    val_interval,
    worst_spike,
)
from benchmarks.convergence_settings import DEFAULT_SPARSE, SETTINGS, SWEEPS, flush_of, overrides


def test_the_run_length_reaching_the_target_is_interpolated_between_the_two_around_it():
    runs = [(300, 3.04, 16.0), (330, 3.00, 17.5), (360, 2.96, 19.0)]  # (steps, final loss, training seconds)
    steps, time_s, bracketed = horizon_to(3.03, runs)
    assert bracketed and steps == pytest.approx(307.5) and time_s == pytest.approx(16.375)
    assert horizon_to(3.05, runs) == (300, 16.0, False)  # the shortest run already reaches it: an upper bound
    assert horizon_to(2.90, runs) is None  # no run reaches it


def test_training_seconds_come_from_each_interval_tokens_over_its_logged_rate(tmp_path):
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"global_batch_size": 16, "data": {"seq_len": 64}}))
    logs = tmp_path / "csv" / "version_0"
    logs.mkdir(parents=True)
    # steps 9 and 19: 10 steps of 1024 tokens each at 1024 and then 512 tokens/s; a validation row has no rate
    (logs / "metrics.csv").write_text("step,tokens_per_sec,val_loss\n9,1024,\n19,512,\n19,,3.0\n")
    assert seconds(tmp_path) == [(9, 10.0), (19, 30.0)]


def test_a_record_grows_a_seed_without_rerunning_the_first():
    assert list(seeds(argparse.Namespace(seeds=1, first_seed=1))) == [1]  # seed 1 alone, its own init and data order
    assert list(seeds(argparse.Namespace(seeds=3, first_seed=0))) == [0, 1, 2]


def test_sweep_suffixes_add_the_learning_rate_and_the_warm_up():
    assert overrides("2bw+ef+lr2e-3+wu60") == [*SETTINGS["2bw+ef"], "model.lr=2e-3", "model.warmup_steps=60"]
    assert overrides("2bw+pef+strength1.5") == [*SETTINGS["2bw+pef"], "strategy.delay_correction_strength=1.5"]
    assert overrides("flush+b1") == SETTINGS["flush+b1"]  # a setting whose own name has a "+"
    assert overrides("rigl75+every10") == [*SETTINGS["rigl75"], "sparsity.update_interval=10"]
    assert overrides("spdf75+denselr0.5") == [*SETTINGS["spdf75"], "sparsity.dense_lr=0.5"]
    assert overrides("dense+width48") == [*SETTINGS["dense"], "model.config.n_embd=48"]
    assert overrides("2bw+dense+sync250+lr8e-3") == [*SETTINGS["2bw+dense"], "strategy.sync_steps=250", "model.lr=8e-3"]
    with pytest.raises(SystemExit, match="unknown setting '2bw\\+xx'"):
        overrides("2bw+xx")


def test_the_worst_spike_is_a_loss_over_the_median_of_the_ten_before():
    losses = [4.0, 3.9, 3.8, 3.7, 3.6, 3.5, 3.4, 3.3, 3.2, 3.1, 3.0, 5.1, 3.0]
    # step 10: 3.0 / median(4.0 .. 3.1) = 3.0 / 3.55; step 11: 5.1 / median(3.9 .. 3.0) = 5.1 / 3.45 (the worst)
    assert worst_spike(losses) == pytest.approx(5.1 / 3.45)
    assert worst_spike(losses[:10]) == 1.0  # no step has ten before it


def test_an_interrupted_run_is_removed_so_its_rerun_curve_is_its_own(tmp_path):
    interrupted = tmp_path / "csv" / "version_0"
    interrupted.mkdir(parents=True)
    (interrupted / "metrics.csv").write_text("step,val_loss\n49,3.65\n")
    assert curve(tmp_path) == [(49, 3.65)]
    assert not finished(tmp_path) and not tmp_path.exists()  # the rerun's log would be csv/version_1 beside it
    (tmp_path / "csv" / "version_0").mkdir(parents=True)
    (tmp_path / "summary.json").write_text("{}")
    assert finished(tmp_path) and (tmp_path / "csv").exists()  # a finished run is kept and reused


def test_each_setting_is_compared_with_flush_at_its_own_rate_and_warm_up():
    assert flush_of("2bw+pef+lr6e-4+wu60") == "flush+lr6e-4+wu60"
    assert flush_of("2bw+ef+strength2") == flush_of("2bw+ef@330") == "flush"  # Flush has no correction to strengthen
    assert flush_of("2bw+dense") == flush_of("2bw+ef+dense") == "flush+dense"  # dense against dense
    assert flush_of("dense") == flush_of("dense+strength0.5") == "flush+dense"  # the default 2BW, dense (was "flush")
    results = {
        "stdlib/muon/flush": {"final": [2.0, 2.0]},
        "stdlib/muon/flush+lr6e-4": {"final": [2.5, 2.5]},
        "stdlib/muon/2bw+pef+lr6e-4": {"final": [2.505, 2.505]},
        "stdlib/muon/2bw+pef+wu100": {"final": [2.02, 2.02]},
    }
    rows = table(results).splitlines()
    assert "| 2bw+pef+lr6e-4 | 2.5050 ± 0.0000 | +0.20% |" in rows[4]
    assert "| 2bw+pef+wu100 | 2.0200 ± 0.0000 | +1.00% (vs flush) |" in rows[5]  # no flush+wu100: said so


def test_every_sweep_setting_resolves_and_a_later_key_wins():
    for job in (job for jobs in SWEEPS.values() for job in jobs):
        for setting in job["settings"].split(","):
            keys = [o.split("=")[0] for o in overrides(setting)]
            assert len(keys) == len(set(keys)), setting
    window = overrides("s75+global+from0.5+to0.9")
    assert "sparsity.start_step=@0.5" in window and "sparsity.end_step=@0.9" in window
    assert "sparsity.start_step=0" not in window and "sparsity.allocation=global" in window
    assert overrides("s75+win+global+rewarm25")[-1] == "sparsity.rewarmup_steps=25"
    assert overrides("dense+b1_0.85") == ["sparsity=none", "model.betas=[0.85,0.95]"]  # AdamW's beta1 alone


def test_training_flops_are_the_mean_logged_ratio(tmp_path):
    logs = tmp_path / "csv" / "version_0"
    logs.mkdir(parents=True)
    (logs / "metrics.csv").write_text("step,sparsity/flops_ratio\n9,1.0\n19,0.5\n19,\n29,0.4\n29,0.3\n")
    assert flops_ratio(tmp_path) == pytest.approx((1.0 + 0.5 + 0.3) / 3)  # the end's measurement repeats step 29
    (logs / "metrics.csv").write_text("step,val_loss\n9,3.0\n")
    assert flops_ratio(tmp_path) == 1.0  # dense: nothing logged


def test_every_run_validates_at_its_last_step():
    """Issue 50: the final validation loss is the last step's, at every run length (a 2,200-step horizon with
    validation every 250 steps would have ended on step 2,000's)."""
    assert val_interval(1000, 250) == 250 and val_interval(2000, 250) == 250
    assert val_interval(2200, 250) == 275 and val_interval(2400, 250) == 240 and val_interval(640, 160) == 160
    for steps in (1145, 1500, 1750, 2200, 2400, 3000):
        assert steps % val_interval(steps, 250) == 0


def test_the_sweeps_default_is_the_configs():
    """The sweep's "default" rows are what ``sparsity=gradual`` trains: the window, allocation and shape of
    conf/sparsity/gradual.yaml."""
    config = yaml.safe_load((ROOT / "conf" / "sparsity" / "gradual.yaml").read_text())
    keys = dict(o.split("=", 1) for o in overrides(DEFAULT_SPARSE))
    assert keys["sparsity.start_step"] == "@0.25" and config["start_step"] == "${mul:${trainer.max_steps},0.25}"
    assert keys["sparsity.end_step"] == "@0.95" and config["end_step"] == "${mul:${trainer.max_steps},0.95}"
    assert (keys["sparsity.allocation"], keys["sparsity.shape"]) == (config["allocation"], config["shape"])


def test_the_equal_parameter_comparator_matches_the_average_non_embedding_count():
    """Jin et al.'s comparator (``benchmarks/comparator.py``), by hand: the tiny GPT (4 blocks, width 64) at a quarter
    density keeps 4 x (12 x 64^2 / 4 + 13 x 64) + 2 x 64 = 52,608 non-embedding parameters; dense at width 32 has
    4 x (12 x 32^2 + 13 x 32) + 64 = 50,880 and at width 36 64,152, so 32 is the nearest width."""
    from benchmarks.comparator import equal_params_width, non_embedding
    from lightning_pd2bw.models import GPTConfig

    tiny = GPTConfig.from_name("tiny")
    assert non_embedding(tiny, 0.25) == 52_608
    assert non_embedding(GPTConfig.from_name("tiny", n_embd=32)) == 50_880
    assert equal_params_width("gpt_tiny", 0.25) == 32
    assert equal_params_width("gpt_tiny", 1.0) == 64
    assert equal_params_width("gpt_small", 0.25) == 128  # width 256 at a quarter: about half the width


def test_a_run_at_another_width_counts_its_own_flops(tmp_path):
    """``+widthN`` runs (the comparator in the sweep tables) count their FLOPs against the preset's width, from the
    run's resolved config; the preset's own width (``n_embd: null``) counts 1.0."""
    from benchmarks.comparator import dense_flops, width_flops
    from lightning_pd2bw.models import GPT, GPTConfig

    (tmp_path / "config.yaml").write_text("model:\n  config:\n    name: tiny\n    n_embd: 48\n")
    by_hand = (
        GPT(GPTConfig.from_name("tiny", n_embd=48)).flops_per_token()
        / GPT(GPTConfig.from_name("tiny")).flops_per_token()
    )
    assert width_flops(tmp_path, "gpt_tiny") == pytest.approx(by_hand) and 0.4 < by_hand < 0.75
    assert dense_flops("gpt_tiny", 64) == 1.0
    (tmp_path / "config.yaml").write_text("model:\n  config:\n    name: tiny\n    n_embd: null\n")
    assert width_flops(tmp_path, "gpt_tiny") == 1.0


@pytest.mark.parametrize("model", ["gpt_tiny", "gpt_small"])
def test_the_transfer_benchmark_reads_each_models_peak_rate_from_its_config(model):
    """The fine-tune's rate is a third of the pre-training rate Hydra composes for the model (never a typed copy)."""
    from hydra import compose, initialize_config_dir

    from benchmarks.transfer import peak_lr
    from lightning_pd2bw.cli.train import CONF, setup_hydra

    setup_hydra()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        composed = compose("config", overrides=[f"model={model}"])
    assert peak_lr(model) == float(composed.model.lr)


def test_the_transfer_rate_sweep_names_runs_by_rate_and_tunes_at_a_third_of_the_best(tmp_path, monkeypatch):
    """Seed 0 pre-trains a row (here a comparator) at each multiple of the model's rate, each run named by its rate
    itself (the model's own too: a later change of the default must not pass its runs off as at the new rate); the
    fine-tune of the chosen one runs at a third of it."""
    import argparse

    import benchmarks.transfer as transfer

    rate = transfer.peak_lr("gpt_tiny")
    losses = {
        f"pretrain-dense48-sparse75-lr{rate:g}-seed0": 3.1,
        f"pretrain-dense48-sparse75-lr{2 * rate:g}-seed0": 2.9,
    }
    losses[f"pretrain-dense48-sparse75-lr{rate / 2:g}-seed0"] = 3.3
    calls = []

    def fake_train(folder, args, seed, steps, corpus, extra):  # records the run instead of training it
        calls.append((folder.name, extra))
        return folder

    monkeypatch.setattr(transfer, "train", fake_train)
    monkeypatch.setattr(transfer, "curve", lambda folder: [(100, losses[folder.name])])
    args = argparse.Namespace(
        model="gpt_tiny", rates=[0.5, 1.0, 2.0], out=tmp_path, pretrain_steps=100, pretrain="stdlib"
    )
    sweep = transfer.rate_sweep(args, "dense48-sparse75", ["sparsity=none", "model.config.n_embd=48"])
    assert sweep == {float(f"{rate / 2:.3g}"): 3.3, rate: 3.1, float(f"{2 * rate:.3g}"): 2.9}
    assert calls[1] == (
        f"pretrain-dense48-sparse75-lr{rate:g}-seed0",
        ["sparsity=none", "model.config.n_embd=48", f"model.lr={rate:g}"],
    )
    assert calls[2][1][-1] == f"model.lr={2 * rate:g}"
    assert transfer.fine_tune(args, 500, peak=2 * rate)[0] == f"model.lr={2 * rate / 3:.3g}"
    assert transfer.fine_tune(args, 500)[0] == f"model.lr={rate / 3:.3g}"
