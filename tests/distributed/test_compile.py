"""``compile=...``: each stage's layers under ``torch.compile`` train as the eager engine does (within floating-point
tolerance, over 2BW's weight-version swaps, drains, evaluation and prediction) and compile nothing after warm-up;
the Hydra CLI's ``strategy.compile=true`` reports the counts in the run's summary."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lightning_pd2bw import PipeDream2BWStrategy
from lightning_pd2bw.engine.compiled import compile_options

from .launch import torchrun_script
from .test_launchers import SMALL_RUN, run

SEQ = 16
VOCAB = 256
RUNS = {
    # inductor (torch.compile's default backend), fp32: what `compile=True` gives a CPU user
    "2bw_inductor": dict(mode="2bw", recompute=False, bf16=False, compile={}, rtol=1e-4, atol=1e-5),
    # recomputation (the backward reruns the compiled forward) and bf16 autocast with bfloat16 boundaries
    "2bw_recompute_bf16": dict(
        mode="2bw", recompute=True, bf16=True, compile={"backend": "aot_eager"}, rtol=2e-2, atol=2e-2
    ),
    "flush_aot_eager": dict(mode="flush", recompute=False, bf16=False, compile={"backend": "aot_eager"}, rtol=1e-5),
}


def _batch(generator: torch.Generator, rows: int, seq: int = SEQ) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (rows, seq + 1), generator=generator)
    return {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}


def spec_of(name: str, options: dict) -> dict:
    generator = torch.Generator().manual_seed(7)
    seen = [_batch(generator, 8), _batch(generator, 8)]  # two batches in turn: the loss falls within 6 steps
    return {
        "name": name,
        "mode": options["mode"],
        "num_stages": 2,
        "num_microbatches": 4,
        "recompute": options["recompute"],
        "bf16": options["bf16"],
        "compile": options["compile"],
        "model": dict(n_layer=2, n_head=2, n_embd=32, block_size=2 * SEQ, vocab_size=VOCAB),
        "batches": seen * 3,
        "drain_at": [3],
        "probes": [_batch(generator, 8), _batch(generator, 8)],
        "other_shape": _batch(generator, 8, seq=2 * SEQ),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    folder = tmp_path_factory.mktemp("compile")
    torch.save({"runs": [spec_of(name, options) for name, options in RUNS.items()]}, folder / "spec.pt")
    torchrun_script(Path(__file__).with_name("run_compile.py"), [str(folder / "spec.pt"), str(folder)], 2)
    return {name: [torch.load(folder / f"{name}-rank{r}.pt", weights_only=False) for r in range(2)] for name in RUNS}


@pytest.mark.parametrize("name", list(RUNS))
def test_compiled_layers_train_as_eager_and_compile_nothing_after_warmup(results, name):
    tolerance = dict(rtol=RUNS[name]["rtol"], atol=RUNS[name].get("atol", 1e-6))
    for rank, result in enumerate(results[name]):
        eager, compiled = result["eager"], result["compiled"]
        assert [x is None for x in compiled["losses"]] == [x is None for x in eager["losses"]]
        got = torch.tensor([x for x in compiled["losses"] if x is not None])
        want = torch.tensor([x for x in eager["losses"] if x is not None])
        assert len(want) == 6 and want[0] > want[-1], "the run learns"
        torch.testing.assert_close(got, want, **tolerance)
        for a, b in zip(compiled["evaluations"], eager["evaluations"], strict=True):
            torch.testing.assert_close(torch.tensor(a["loss"]), torch.tensor(b["loss"]), **tolerance)
        for a, b in zip(compiled["predictions"], eager["predictions"], strict=True):
            torch.testing.assert_close(a, b, rtol=tolerance["rtol"] * 10, atol=tolerance["atol"] * 10)
        for key, value in eager["weights"].items():
            torch.testing.assert_close(compiled["weights"][key], value, **tolerance, msg=lambda m, k=key: f"{k}: {m}")
        counters = compiled["counters"]
        # every stage compiled its layers: training (grad mode), evaluation and prediction (no_grad) at least
        assert counters["compile/graphs"] >= 2, (rank, counters)
        assert counters["compile/recompiles_after_warmup"] == 0, (rank, counters)
        assert eager["counters"] == {}
        # the meter's positive control: a batch of another sequence length compiles after warm-up, and is counted
        assert result["compiled"]["counters_after_new_shape"]["compile/recompiles_after_warmup"] > 0, rank


@pytest.mark.smoke
def test_compile_options_are_checked_by_name():
    assert compile_options(False, "2bw") is None and compile_options(True, "2bw") == {}
    assert compile_options({"backend": "aot_eager", "options": {"a": 1}}, "flush") == {
        "backend": "aot_eager",
        "options": {"a": 1},
    }
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['fulgraph'\]; torch.compile takes .*fullgraph"):
        compile_options({"fulgraph": True}, "2bw")
    with pytest.raises(ValueError, match="records CUDA graphs.*max-autotune-no-cudagraphs"):
        compile_options({"mode": "reduce-overhead"}, "2bw")
    assert compile_options({"mode": "reduce-overhead"}, "flush") == {"mode": "reduce-overhead"}
    with pytest.raises(ValueError, match="compile='yes' is invalid"):
        compile_options("yes", "2bw")
    with pytest.raises(ValueError, match=r"PipeDream2BWStrategy\(compile=...\) has unknown key\(s\) \['fulgraph'\]"):
        PipeDream2BWStrategy(compile={"fulgraph": True})


def test_cli_compile_reports_graphs_and_no_recompiles_in_the_summary(tmp_path):
    """``pd2bw-train strategy.compile=true``: 2BW over 2 processes with validation (a drain and an evaluation run)
    every 3 steps and a checkpoint; the summary counts the graphs and 0 after warm-up."""
    out = tmp_path / "run"
    args = [arg for arg in SMALL_RUN if not arg.startswith("trainer.max_steps")]
    run(
        [
            sys.executable,
            "-m",
            "lightning_pd2bw.cli.train",
            *args,
            "trainer.max_steps=9",
            "sparsity=none",
            "strategy.compile=true",
            f"paths.output_dir={out}",
        ],
        tmp_path,
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["global_step"] == 9
    assert summary["compile/graphs"] >= 4, summary  # 2 ranks x (training + evaluation)
    assert summary["compile/recompiles_after_warmup"] == 0, summary
    assert summary["train_loss"] < 5.5, summary
    # sparsity=none over the tiny recipe (which sets sparsity.sparsity): dense, and the saved config says so
    assert not any(key.startswith("sparsity/") for key in summary), summary
    assert yaml.safe_load((out / "config.yaml").read_text())["sparsity"] is None
