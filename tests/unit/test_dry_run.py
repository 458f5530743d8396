"""``dry_run=true``: the plan a run would train, printed without allocating: parameters, layout, tokens and cost,
every buffer each stage holds, the warnings with their fixes where a stage does not fit, and a bad layout refused
before any process starts."""

from __future__ import annotations

import re

import pytest

from ..cli import run_cli


def test_gpt13b_dry_run_prints_the_plan_without_allocating(tmp_path):
    result = run_cli("recipe=gpt13b", "dry_run=true", f"paths.output_dir={tmp_path}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "12,853,626,880 parameters (12.85B)" in out
    assert "64 processes = 4 stages x 16 replicas" in out and "32 microbatches x 2 sequences" in out
    assert "tokens per step = 1024 x 2048 = 2,097,152" in out
    assert out.count("est. memory") == 4 and "stage 3: layers 31..41" in out
    # issue 63, 4: what the run costs. 143,052 steps x 2,097,152 tokens, in uint16 ids (vocabulary 50,304)
    assert "cost: 143,052 steps (trainer.max_steps) = 300.00B tokens, 600.0 GB tokenized for one epoch" in out


def test_dry_run_with_a_lookahead_counts_its_stash(tmp_path):
    """strategy.lookahead=1: the layout line says so and every stage plans one more microbatch of activations (3
    instead of 2 on stage 0, 2 instead of 1 on the last stage, at d = 2, m = 4)."""

    def activations(*overrides: str) -> tuple[str, list[float]]:
        result = run_cli("dry_run=true", *overrides, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        lines = [line for line in result.stdout.splitlines() if "est. memory" in line]
        return result.stdout, [float(line.split("activations ")[1].split(",")[0]) for line in lines]

    plain_out, plain = activations()
    ahead_out, ahead = activations("strategy.lookahead=1")
    assert "lookahead" not in plain_out and "mode=2bw lookahead=1 " in ahead_out
    # the dry run prints GiB to 2 decimals: each value is within 0.005 of its own, so the ratios hold to that bound
    assert ahead[1] == pytest.approx(plain[1] * 2, abs=0.005 * 3 + 1e-9)
    assert ahead[0] == pytest.approx(plain[0] * 3 / 2, abs=0.005 * 2.5 + 1e-9)


def memory_terms(stdout: str) -> list[dict[str, float]]:
    lines = [line for line in stdout.splitlines() if "est. memory" in line]
    terms = [line.split("GiB (")[1].rstrip(")").split(", ") for line in lines]
    return [{name: float(value) for name, value in (t.rsplit(" ", 1) for t in stage)} for stage in terms]


def test_the_dry_run_counts_every_buffer_and_warns_what_does_not_fit(tmp_path):
    """Each stage's estimate lists every buffer the engine holds: the delay correction's copies of the weights (two
    for the default 2BW correction, one for error_feedback; strategy.delay_correction=null frees them), the outputs
    kept for the backward, the messages in flight, NCCL's buffers. A stage that does not fit the cluster's device
    gets a warning with the fixes."""
    base = ("recipe=gpt13b", "strategy.num_stages=8", "dry_run=true", f"paths.output_dir={tmp_path}")  # 8 x 8
    corrected = run_cli(*base, cwd=tmp_path)
    first_order = run_cli(*base, "strategy.delay_correction=error_feedback", cwd=tmp_path)
    plain = run_cli(*base, "strategy.delay_correction=null", cwd=tmp_path)
    whole = run_cli(*base, "strategy.shard_optimizer=false", cwd=tmp_path)
    for done in (corrected, first_order, plain, whole):
        assert done.returncode == 0, done.stderr[-3000:]
    with_correction, without = memory_terms(corrected.stdout), memory_terms(plain.stdout)
    stages = zip(with_correction, without, memory_terms(first_order.stdout), memory_terms(whole.stdout))
    for stage, (a, b, c, unsharded) in enumerate(stages):
        assert {"correction", "outputs", "transport", "communication"} <= set(a)
        weights = unsharded["weights"] / 2  # 4 bytes a parameter: two bf16 versions, or the float32 master
        # the optimizer sharded over the 8 replicas of each stage (shard_optimizer, the default), by whole tensors:
        # the fullest replica steps at least 1/8 of the stage (error_feedback's one buffer of its share); on the first
        # and the last stage (the tied embedding's owner there) more, and it holds the embedding's two AdamW states
        # where the blocks' Muon matrices hold one: more of the optimizer than of the elements (issue 95)
        fraction = c["correction"] / weights
        assert fraction >= 1 / 8 - 1e-3 and (fraction > 1 / 8 + 0.01) == (stage in (0, len(with_correction) - 1))
        held = a["optimizer"] / unsharded["optimizer"]
        assert held >= fraction - 0.01 and (held > fraction + 0.01) == (stage in (0, len(with_correction) - 1))
        share = weights * fraction
        assert a["correction"] == pytest.approx(2 * share, abs=0.015) and b["correction"] == 0.0  # 2-decimal prints
        assert unsharded["correction"] == pytest.approx(2 * weights, abs=0.01)
        # sharded: the float32 masters of its share only; gradients to their owners (the recipe's default since
        # 0.14.0): one buffer and its share set aside (2BW); unsharded, two whole buffers
        assert a["weights"] == pytest.approx(weights + share, abs=0.02)
        assert a["gradients"] == pytest.approx(weights + share, abs=0.02)
        assert unsharded["gradients"] == pytest.approx(2 * weights, abs=0.01)
        assert a["transport"] > 0 and a["communication"] > 0
        assert (a["outputs"] > 0) == (stage < len(with_correction) - 1)
    small = run_cli(*base, "+cluster=v100_16g_8x8", cwd=tmp_path)
    assert small.returncode == 0, small.stderr[-3000:]
    warnings = [line for line in small.stdout.splitlines() if line.startswith("WARNING: stage")]
    assert len(warnings) == 8 and "strategy.delay_correction=null (saves" in warnings[0]
    assert "strategy.delay_correction=error_feedback (saves" in warnings[0]  # one buffer of the two
    # Flush applies no correction (the run resolves that once): its advice never offers to drop one
    flush = run_cli(*base, "+cluster=v100_16g_8x8", "strategy.mode=flush", cwd=tmp_path)
    warnings = [line for line in flush.stdout.splitlines() if line.startswith("WARNING: stage")]
    assert warnings and not any("delay_correction" in line for line in warnings), flush.stdout[-3000:]


def test_bert_dry_run_and_a_bad_layout_fails_before_any_process(tmp_path):
    result = run_cli("recipe=bert_large", "dry_run=true", cwd=tmp_path)
    assert result.returncode == 0 and "4 stages x 4 replicas" in result.stdout and "bert_large" in result.stdout
    bad = run_cli("recipe=tiny", "trainer.devices=3", "strategy.num_stages=2", cwd=tmp_path, in_process=False)
    assert bad.returncode != 0 and "bad configuration" in bad.stderr and "strategy.num_stages" in bad.stderr
    unknown = run_cli("recipe=gpt14b", cwd=tmp_path)
    assert unknown.returncode != 0 and "valid: bert_base, bert_large" in unknown.stderr


def test_the_dry_run_proposes_the_fewest_layers_to_recompute_per_stage(tmp_path):
    """Issue 62, 2: gpt13b at micro-batch 4 on 8 x 8 H100 does not fit without recomputation (stages 0 and 1; micro 2
    fits since the float32 masters and the set-aside gradients are sharded, 0.13.0); the warning names, per stage,
    the fewest first layers whose recomputation makes every stage fit, and that run fits."""

    base = (
        "recipe=gpt13b",
        "micro_batch_size=4",
        "+cluster=h100_80g_8x8",
        "dry_run=true",
        f"paths.output_dir={tmp_path}",
    )
    over = run_cli(*base, cwd=tmp_path)
    assert over.returncode == 0, over.stderr[-3000:]
    step = float(re.search(r"\(([\d.]+) s per step", over.stdout)[1])  # the plan's, on the cluster
    days, hours = re.search(
        r"cost: 143,052 steps .* = ([\d.]+) days on 64 devices, ([\d,]+) device-hours", over.stdout
    ).groups()
    assert abs(float(days) - 143_052 * step / 86_400) <= 0.05 + 143_052 * 0.005 / 86_400  # the step is printed rounded
    assert abs(int(hours.replace(",", "")) - 143_052 * step * 64 / 3600) <= 1 + 143_052 * 0.005 * 64 / 3600
    warnings = [line for line in over.stdout.splitlines() if line.startswith("WARNING: stage")]
    proposed = re.search(
        r"'strategy\.layers_per_stage=(\[[\d,]+\])' 'strategy\.recompute=(\[[\d,]+\])' \(per stage, the fewest",
        warnings[0],
    )
    assert warnings and proposed, over.stdout[-3000:]
    counts = [int(c) for c in proposed[2].strip("[]").split(",")]
    assert counts[0] > 0 and counts[-1] == 0 and counts == sorted(counts, reverse=True)
    # the cut it was computed for goes with it (recomputation changes the planner's time-balanced cut)
    fits = run_cli(*base, f"strategy.layers_per_stage={proposed[1]}", f"strategy.recompute={proposed[2]}", cwd=tmp_path)
    assert fits.returncode == 0 and "WARNING: stage" not in fits.stdout, fits.stdout[-3000:]
    assert "the first" in fits.stdout and "recomputed" in fits.stdout  # each stage line says how many


@pytest.mark.parametrize(
    "overrides,refusal",
    [
        ((), "trainer.precision=32-true computes in torch.float32; the kernels take bfloat16"),
        (("trainer.precision=bf16-mixed", "trainer.accelerator=cpu"), "no CUDA device (a CPU run)"),
        (("trainer.precision=bf16-mixed", "+cluster=h100_80g_8x8"), None),
    ],
    ids=["float32", "a CPU", "a cluster of H100"],
)
def test_the_dry_run_warns_where_the_run_refuses_the_2of4_kernels(tmp_path, overrides, refusal):
    """Issue 97, item 5: the dry run says what the run would do with ``sparsity.kernels=true``: refused on a CPU or
    at float32 (``sparsity/semi_sparse.py``'s refusal), and planned at 1.0x where no speed-up was measured."""
    result = run_cli("sparsity=semi_structured", "sparsity.kernels=true", "dry_run=true", *overrides, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "planned at 1.0x: no speed-up measured" in result.stdout
    warned = [line for line in result.stdout.splitlines() if line.startswith("WARNING: the run refuses the 2:4")]
    assert (refusal is None and not warned) or (warned and refusal in warned[0]), result.stdout[-3000:]


def test_an_interleaved_dry_run_shows_each_stages_chunks(tmp_path):
    """strategy.mode=interleaved: each stage's two chunks (stage s holds chunks s and s + d of the layers cut in 2d),
    every layer in exactly one chunk, and more activations on stage 0 than Flush's (its warm-up of P + 2 (d - 1)
    chunk-microbatches against 1F1B's d stage-microbatches)."""
    result = run_cli("strategy.mode=interleaved", "dry_run=true", f"paths.output_dir={tmp_path}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if "est. memory" in line]
    assert len(lines) == 2 and all("chunks of layers" in line for line in lines)
    spans = [re.findall(r"(\d+)\.\.(\d+)", line.split(",", 2)[0] + "," + line.split(",")[1]) for line in lines]
    covered = sorted(i for stage in spans for a, b in stage for i in range(int(a), int(b) + 1))
    assert covered == list(range(10))  # GPT small's 10 pipeline layers, each once
    flush = run_cli("strategy.mode=flush", "dry_run=true", f"paths.output_dir={tmp_path}", cwd=tmp_path)
    assert memory_terms(result.stdout)[0]["activations"] > memory_terms(flush.stdout)[0]["activations"]
