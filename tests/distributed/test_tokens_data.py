"""A tokenized corpus end to end, as a user runs it: ``pd2bw-prepare-data`` on local text (a BPE trained on the
spot, nothing downloaded), then ``pd2bw-train data=tokens`` over two pipeline stages, and the gpt13b dry run
naming what it expects."""

from __future__ import annotations

import json
import math
import sys

from lightning_pd2bw.data.corpus import stdlib_files

from ..cli import run_cli
from .test_launchers import SMALL_RUN, run


def test_prepare_then_train_a_pipeline_on_tokens(tmp_path):
    # local text that does not change from one commit to the next (this repository's own sources did, and moved
    # the 6-step loss across the threshold): the first ~400 kB of the standard library's sorted sources
    texts = tmp_path / "texts"
    texts.mkdir()
    size = 0
    for index, source in enumerate(stdlib_files()):
        text = source.read_text(errors="replace")
        (texts / f"{index:03d}_{source.name}.txt").write_text(text)
        size += len(text)
        if size > 400_000:
            break
    corpus = tmp_path / "tokens"
    prepared = run(
        [sys.executable, "-m", "lightning_pd2bw.data.prepare", str(corpus), str(texts),
         "--vocab-size", "512", "--val-fraction", "0.05"],
        tmp_path,
    )  # fmt: skip
    assert "pd2bw-train data=tokens" in prepared.stdout
    out = tmp_path / "run"
    trained = run(
        [sys.executable, "-m", "lightning_pd2bw.cli.train", *SMALL_RUN, "data=tokens", f"data.path={corpus}",
         "model.config.vocab_size=512", "model.lr=1e-2", "model.warmup_steps=2", f"paths.output_dir={out}"],
        tmp_path,
    )  # fmt: skip
    assert f"tokens at {corpus}" in trained.stdout
    summary = json.loads((out / "summary.json").read_text())
    # learned: clearly below uniform over the 512 tokens (ln 512 = 6.24). Two warm-up steps: the default 2BW correction
    # extrapolates the first updates, which lr 1e-2 from the first step made too large (5.95 without them)
    assert summary["global_step"] == 6 and summary["val_loss"] < math.log(512) - 0.3, summary


def test_gpt13b_dry_run_says_what_data_it_expects(tmp_path):
    result = run_cli("recipe=gpt13b", "dry_run=true", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "data: a tokenized corpus at data.path=data/gpt13b (not there" in result.stdout
    assert "pd2bw-prepare-data data/gpt13b YOUR_TEXT_FILES_OR_DIRS --vocab-size 50304" in result.stdout


def test_a_missing_corpus_stops_before_any_process_starts(tmp_path):
    result = run_cli(*SMALL_RUN, "data=tokens", f"data.path={tmp_path / 'no'}", cwd=tmp_path)
    assert result.returncode != 0
    assert "Prepare one with: pd2bw-prepare-data" in result.stdout + result.stderr
