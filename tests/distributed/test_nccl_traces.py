"""The communication of real runs, replayed under NCCL's semantics.

Every case of ``cases.py`` records each rank's ``torch.distributed`` calls (``run_cases.py``). A run over
gloo issues the same calls in the same order as over NCCL, so replaying them in ``nccl_model`` shows
whether the same job could hang on GPUs, with communicators progressing independently and with kernels one at
a time: no case may. The same calls unbatched (each send and receive its own kernel) must deadlock, and the
lowering of the schedules
(``comm_plan.programs``, used for the exhaustive layout sweep) must issue exactly the calls the real
runs issued on the pipeline's own process groups.
"""

from __future__ import annotations

import json
import re

import pytest

from lightning_pd2bw.engine.verify.comm_plan import CommLayout, programs
from lightning_pd2bw.engine.verify.nccl_model import SEND, WAIT, Deadlock, Op, load_program, simulate

from .cases import CASES
from .test_equivalence import as_run


def recorded(folder) -> dict[int, list[Op]]:
    files = sorted(folder.glob("calls-rank-*.json"))
    assert files, f"no recorded calls in {folder}"
    return {int(re.search(r"(\d+)\.json$", f.name).group(1)): load_program(f) for f in files}


@pytest.mark.parametrize("name", list(CASES))
def test_real_run_is_deadlock_free_under_nccl(trained, name):
    calls = recorded(trained[name])
    outcome = simulate(calls)
    assert outcome.steps > 0
    assert simulate(calls, serialized=True).steps == outcome.steps  # CUDA_DEVICE_MAX_CONNECTIONS=1
    if CASES[name].async_checkpoint:  # the checkpoint's collectives run in their own thread, on their own group
        background = {op.channel for ops in calls.values() for op in ops if op.thread and op.kind != "wait"}
        assert len(background) == 1 and not background & {op.channel for op in calls[0] if not op.thread}
    if as_run(trained, name)[0].num_stages > 1:  # plan="auto" may choose one stage
        pipeline = [op for op in calls[0] if op.channel.startswith(("pd2bw/p2p/", "pd2bw/ring/"))]
        assert pipeline, "the pipeline's messages recorded"
        assert any(op.batch >= 0 for op in pipeline), "sent in batches"


def unbatched(calls: dict[int, list[Op]]) -> dict[int, list[Op]]:
    """The same calls, each send and receive issued alone (its own kernel)."""
    return {r: [op._replace(batch=-1) for op in ops] for r, ops in calls.items()}


@pytest.mark.parametrize(
    "name",
    ["gpt_flush_adamw_clip_sched", "gpt_2bw_adamw_clip_sched", "gpt_2bw_d4_adamw", "gpt_interleaved_d4_sgd_momentum"],
)
def test_the_same_calls_unbatched_deadlock(trained, name):
    """Batching is what makes one group per pair safe: 1F1B's steady-state exchange, unbatched, is a cycle; so is the
    ring's (interleaved 1F1B: the sends of a tick, each alone, wait for receives queued behind the neighbours')."""
    with pytest.raises(Deadlock, match="deadlock under NCCL semantics"):
        simulate(unbatched(recorded(trained[name])))


def normalised(ops: list[Op]) -> list[tuple]:
    """The pipeline's own calls: issues by kind, channel, peer and collective, and which of them each wait
    awaits (waits on sends are left out: the transport forgets sends that completed by themselves). Sharded
    gradients: a bucket's reduces to its owners, issued back to back on one communicator and waited for together,
    count as one (the lowering issues one per replica; a real bucket holds the parameters of some owners only); so do
    the sharded optimizer's broadcasts of one step (the lowering issues one per owner, a run one per tensor)."""
    ours = [op for op in ops if op.channel.startswith("pd2bw/") or op.kind == WAIT]
    index: dict[int, tuple[int, str]] = {}
    out: list[tuple] = []
    for op in ours:
        if op.kind == WAIT:
            if op.handle in index and index[op.handle][1] != SEND and out[-1] != ("wait", index[op.handle][0]):
                out.append(("wait", index[op.handle][0]))
        else:
            entry = (op.kind, op.channel, op.peer, op.members, op.name)
            owners = op.name == "reduce" or (op.name == "broadcast" and op.channel.startswith("pd2bw/shard/"))
            if owners and out and out[-1] == entry:  # one bucket's owners, one step's weights: one entry (below)
                index[op.handle] = (len(out) - 1, op.kind)
                continue
            index[op.handle] = (len(out), op.kind)
            out.append(entry)
    return out


LOWERED = [
    n
    for n, c in CASES.items()
    if not (c.sparsity or c.checkpoint_every or c.plan)  # their callbacks and saves add collectives of their own
]


@pytest.mark.parametrize("name", LOWERED)
def test_lowering_issues_what_the_run_issued(trained, name):
    case, width = as_run(trained, name)
    layout = CommLayout(
        mode=case.mode,
        num_stages=case.num_stages,
        num_microbatches=case.num_microbatches,
        data_parallel_size=width,
        steps=case.steps,
        clip="global" if case.clip else None,
        tied=True,  # GPT and BERT tie the token embedding to the output layer
        skip_nonfinite=case.poison_step is not None,
        drain_after=case.periodic_drains,
        sync_steps=case.start if case.mode == "2bw" else 0,  # lowered: each start step drains at once
        eval_batches=2 if case.val_every else 0,
        lookahead=case.lookahead,
        shard_gradients=case.shard_gradients is not False,  # None: the default, on (no case at width > 1 is RigL)
        placement=case.placement,
        virtual_stages=case.virtual_stages,
    )
    lowered = programs(layout)
    calls = recorded(trained[name])
    assert set(lowered) == set(calls)
    for rank in calls:
        assert normalised(lowered[rank]) == normalised(calls[rank]), f"rank {rank}"


@pytest.mark.parametrize("name", ["gpt_2bw_d4_adamw", "gpt_flush_d2w2_adamw", "gpt_2bw_validate", "bert_2bw_adamw"])
def test_shapes_travel_once_per_boundary_and_phase(trained, name):
    """One header per boundary for training (every batch has the same shapes) and one for evaluation, not one
    per microbatch: the steady state makes no host sync for shapes."""
    case, width = as_run(trained, name)
    phases = 2 if case.val_every else 1
    for rank in range(case.num_stages * width):
        counters = json.loads((trained[name] / f"rank-{rank}.json").read_text())
        last, first = counters["stage"] == case.num_stages - 1, counters["stage"] == 0
        assert counters["headers_sent"] == (0 if last else phases)
        assert counters["headers_received"] == (0 if first else phases)
