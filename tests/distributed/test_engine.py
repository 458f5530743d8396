"""``PipelineEngine`` without Lightning: a plain PyTorch loop under torchrun (Lightning made unimportable in the
ranks) trains to the same weights as the single-process reference the Lightning runs are checked against."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from lightning_pd2bw.engine.layout import Layout
from lightning_pd2bw.engine.schedules import schedule as S

from .cases import SEQ_LEN, Case, blocks_of, replica_batch
from .launch import torchrun_script
from .reference import assert_within_rounding, outside_rounding, reference_weights, rounding_bounds

RUNS = [
    Case("engine_2bw_schedule", mode="2bw", steps=5, schedule=True),  # tied sums deferred, per-batch lr
    Case("engine_flush_clip", mode="flush", steps=4, clip=0.5),
    # Clipping(value, "value"): every gradient entry clamped, tied ones after their sum over the stages
    Case("engine_2bw_clip_value", mode="2bw", steps=4, clip=0.002, clip_algorithm="value"),
    # width 2; global clipping; save, rebuild and load at step 3 (a drain): the run goes on as if uninterrupted
    Case("engine_2bw_w2_clip_restart", mode="2bw", width=2, steps=6, clip=0.5, schedule=True, checkpoint_every=3),
    # engine.save at step 3, a new engine with another cut, engine.load (resharding): the run goes on as before
    Case("engine_2bw_reshard_restart", mode="2bw", steps=6, schedule=True, checkpoint_every=3),
    # issue 94: a synchronous start of 3 steps, saved at the switch step and loaded into a new engine: the step count
    # goes on from the checkpoint (2BW from step 3), not from 0 (which would start synchronously again)
    Case("engine_2bw_start_restart", mode="2bw", steps=6, schedule=True, checkpoint_every=3, sync_steps=3),
    # ZB-H1's split backward at width 2 with global clipping, saved at step 3 and loaded into a new engine
    Case("engine_zb_h1_w2_clip_restart", mode="zb_h1", width=2, steps=6, clip=0.5, schedule=True, checkpoint_every=3),
    # interleaved 1F1B (2 chunks a stage on a ring) at width 2 with global clipping and the tied embedding, saved at
    # step 3 and loaded into a new engine
    Case(
        "engine_interleaved_w2_clip_restart",
        mode="interleaved",
        width=2,
        steps=6,
        clip=0.5,
        schedule=True,
        checkpoint_every=3,
    ),
    # three chunks a stage (a GPT of 6 blocks: 8 layers in 6 chunks), engine.save and a load at another cut
    Case("engine_interleaved_v3_reshard", mode="interleaved", virtual_stages=3, steps=6, checkpoint_every=3),
]
RESHARD = {"engine_2bw_reshard_restart": [1, 4], "engine_interleaved_v3_reshard": [1, 2, 1, 1, 2, 1]}  # new cuts
WORLDS = sorted({case.world for case in RUNS})
pytestmark = pytest.mark.smoke  # also in make test: the engine without Lightning, depth 2 and 2 x 2 (~25 s)


def spec_of(case: Case, width: int) -> dict:
    return {
        "name": case.name,
        "mode": case.mode,
        "sync_steps": case.sync_steps,
        "num_stages": case.num_stages,
        "num_microbatches": case.num_microbatches,
        "virtual_stages": case.virtual_stages,
        "model": dict(n_layer=blocks_of(case), n_head=2, n_embd=16, block_size=SEQ_LEN),
        "lr": 3e-3,
        "weight_decay": 0.01,
        "clip": case.clip,
        "clip_algorithm": case.clip_algorithm,
        "warmup_steps": 2 if case.schedule else 0,
        "max_steps": case.steps if case.schedule else None,
        "restart_at": restarts_of(case),
        "reshard_to": RESHARD.get(case.name),
        "batches": [[replica_batch(case, s, r, width) for r in range(width)] for s in range(case.steps)],
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[int, Path]:
    out = {}
    for world in WORLDS:
        folder = tmp_path_factory.mktemp(f"engine{world}")
        cases = [case for case in RUNS if case.world == world]
        torch.save({"runs": [spec_of(c, c.width) for c in cases]}, folder / "spec.pt")
        torchrun_script(Path(__file__).with_name("run_engine.py"), [str(folder / "spec.pt"), str(folder)], world)
        out[world] = folder
    return out


def restarts_of(case: Case) -> list[int]:
    """The steps before which the runner drains, saves and rebuilds the engine (a synchronous start's drains are
    the engine's own)."""
    every = case.checkpoint_every
    return list(range(every, case.steps, every)) if every else []


def returns_a_loss(case: Case) -> list[bool]:
    """What the runner's ``train_batch`` and ``drain()`` calls return, in order: a loss or None. 2BW's loss comes one
    batch late (None first after each drain, and ``drain()`` returns the last); a synchronous start's steps and
    flush return their own at once (flush's ``drain()``: None)."""
    restarts = restarts_of(case)
    out, pending = [], False
    for step in range(case.steps):
        if step in restarts:
            out.append(pending)
            pending = False
        if case.mode != "2bw" or step < case.start:
            out.append(True)
        else:
            out.append(pending)
            pending = True
    return [*out, pending]


@pytest.mark.parametrize("case", RUNS, ids=lambda case: case.name)
def test_plain_pytorch_engine_matches_the_reference(trained, case):
    world, width = case.world, case.width
    folder = trained[world]
    results = [torch.load(folder / f"{case.name}-rank{r}.pt", weights_only=False) for r in range(world)]
    got: dict[str, torch.Tensor] = {}
    for rank, result in enumerate(results):
        replica0 = results[rank % case.num_stages]  # the same stage on replica 0
        for key, value in result["weights"].items():
            torch.testing.assert_close(value, replica0["weights"][key], rtol=0, atol=0)  # replicas stay equal
            got[key] = value
    exact, bounds = rounding_bounds(case, width)
    assert_within_rounding(got, exact, bounds, case.name)
    initial = reference_weights(replace(case, steps=0), width)
    assert max((exact[k] - initial[k]).abs().max().item() for k in exact) > 1e-3, "training moved the weights"
    other = reference_weights(replace(case, mode="flush" if case.mode == "2bw" else "2bw"), width)
    assert outside_rounding(other, exact, bounds), "the bound tells the rules apart"
    if case.clip:
        unclipped = reference_weights(replace(case, clip=None), width)
        assert outside_rounding(unclipped, exact, bounds), "the clipping changed the update"
    losses = [r["losses"] for r in results]
    assert all(x == losses[0] for x in losses[: case.num_stages]), "every stage of a pipeline reports its loss"
    # what train_batch and drain() returned, in order: every batch's loss exactly once, in its order; 2BW: one
    # batch late (None first after each drain; drain() returns the last), flush: at once (drain() returns None)
    per_batch = [v for v in losses[0] if v is not None]
    assert len(per_batch) == case.steps and all(v > 0 for v in per_batch)
    assert [v is not None for v in losses[0]] == returns_a_loss(case), (case.name, losses[0])
    assert {tuple(sorted(r["evaluation"])) for r in results} == {("loss",)}
    # the engine sent through the transport it was given: one message per SEND action of the IR since the last
    # (re)build, plus the evaluation's forwards (one per microbatch)
    start = restarts_of(case)[-1] if restarts_of(case) else 0
    for rank, result in enumerate(results):
        stage = rank % case.num_stages
        layout = Layout(case.num_stages, case.num_microbatches, case.mode, virtual_stages=case.virtual_stages)
        actions = S.stream(layout, stage, case.steps - start)
        if case.mode != "2bw":  # flush restarts its batch numbers every step: the same actions per step
            actions = S.segment(layout, stage, 0) * (case.steps - start)
        evaluation = S.evaluation(stage, case.num_stages, case.num_microbatches, layout.virtual_stages)
        sends = sum(a.kind == S.SEND_FORWARD for a in [*actions, *evaluation])
        assert result["sent"] == {"forward": sends, "backward": sum(a.kind == S.SEND_BACKWARD for a in actions)}


def test_no_lightning_module_was_imported(trained):
    for world, folder in trained.items():
        for rank in range(world):
            assert torch.load(folder / f"imported-rank{rank}.pt") == []
