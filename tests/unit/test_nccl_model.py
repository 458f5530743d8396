"""NCCL's semantics as a model (``nccl_model``), and every schedule's lowering proven free of deadlock in it."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from lightning_pd2bw.engine.comm.grid import STOP_FLAG_GROUP
from lightning_pd2bw.engine.schedules import schedule as S
from lightning_pd2bw.engine.verify.comm_plan import CommLayout, RankProgram, programs
from lightning_pd2bw.engine.verify.nccl_model import (
    COLLECTIVE,
    RECV,
    SEND,
    WAIT,
    Deadlock,
    MismatchedCollective,
    Op,
    simulate,
)
from tests.replaced_transports import replaced_programs


def send(h, peer, channel="c"):
    return Op(SEND, h, channel, peer)


def recv(h, peer, channel="c"):
    return Op(RECV, h, channel, peer)


def wait(h):
    return Op(WAIT, h)


def coll(h, members, name="all_reduce", channel="g"):
    return Op(COLLECTIVE, h, channel, members=members, name=name)


def test_matched_send_and_receive_complete():
    assert simulate({0: [send(0, 1), wait(0)], 1: [recv(0, 0), wait(0)]}).steps == 2


def test_a_send_does_not_complete_before_its_receive_is_posted():
    # gloo would buffer rank 0's send and let rank 0 move on; NCCL does not
    with pytest.raises(Deadlock, match="rank 0 blocked"):
        simulate({0: [send(0, 1), wait(0)], 1: []})


def test_one_channel_per_pair_is_a_cycle_in_1f1b_steady_state():
    # stage 0: SEND_F then RECV_B; stage 1: SEND_B then RECV_F, both directions on one communicator
    stage0 = [send(0, 1), recv(1, 1), wait(1)]
    stage1 = [send(0, 0), recv(1, 0), wait(1)]
    with pytest.raises(Deadlock):
        simulate({0: stage0, 1: stage1})
    # the same calls, each direction on its own communicator: no cycle
    stage0 = [send(0, 1, "act"), recv(1, 1, "grad"), wait(1)]
    stage1 = [send(0, 0, "grad"), recv(1, 0, "act"), wait(1)]
    simulate({0: stage0, 1: stage1})


def test_operations_on_one_communicator_run_in_issue_order():
    # rank 1 posts its receives in the opposite order of rank 0's sends (same channel): stuck
    with pytest.raises(Deadlock):
        simulate({0: [send(0, 1), send(1, 1), wait(1)], 1: [recv(0, 0, "c"), wait(0)] + [recv(1, 0, "d"), wait(1)]})


def test_a_collective_waits_for_every_member():
    with pytest.raises(Deadlock):
        simulate({0: [coll(0, (0, 1)), wait(0)], 1: [recv(0, 0, "x"), wait(0)], 2: [send(0, 1, "y"), wait(0)]})
    assert simulate({0: [coll(0, (0, 1)), wait(0)], 1: [coll(0, (0, 1)), wait(0)]}).steps == 2


def test_a_collective_behind_a_blocked_receive_deadlocks():
    # rank 0 waits in an all-reduce that rank 1 reaches only after a message rank 0 sends after the all-reduce
    rank0 = [coll(0, (0, 1)), wait(0), send(1, 1), wait(1)]
    rank1 = [recv(0, 0), wait(0), coll(1, (0, 1)), wait(1)]
    with pytest.raises(Deadlock):
        simulate({0: rank0, 1: rank1})


def test_mismatched_collectives_are_named():
    with pytest.raises(MismatchedCollective, match="broadcast"):
        simulate({0: [coll(0, (0, 1)), wait(0)], 1: [coll(0, (0, 1), "broadcast"), wait(0)]})


@pytest.mark.parametrize("mode", ["flush", "2bw"])
@pytest.mark.parametrize("num_stages", [2, 4])
def test_the_old_transport_deadlocks(mode, num_stages):
    """Every message of a stage pair on the default group (one communicator per pair), one header per
    microbatch: what ``StageLink`` did before. It hangs under NCCL in both modes."""
    layout = CommLayout(mode, num_stages, num_stages)
    with pytest.raises(Deadlock):
        simulate(replaced_programs(layout, "shared"))
    simulate(programs(layout), serialized=True)


UPDATES = {
    "plain": {},
    "clip_global": {"clip": "global"},
    "clip_stage": {"clip": "stage"},
    "skip_nonfinite": {"skip_nonfinite": True},
    # sharded gradients (width 2): each bucket reduced to its owners, the owners' norm and flags summed over the
    # replicas (blocking) before the pipeline's sums
    "sharded_clip_global_skip": {"shard_gradients": True, "clip": "global", "skip_nonfinite": True},
    "sharded_clip_stage": {"shard_gradients": True, "clip": "stage"},
}


SCHEDULES = (("flush", 0), ("gpipe", 0), ("2bw", 0), ("2bw", 1), ("flush", 1), ("zb_h1", 0))  # (mode, lookahead)


def sweep(microbatches, depths=range(2, 9)):
    for (mode, lookahead), num_stages, width, update, tied in itertools.product(
        SCHEDULES, depths, (1, 2), UPDATES, (False, True)
    ):
        for m in microbatches(num_stages):
            yield CommLayout(
                mode,
                num_stages,
                m,
                width,
                steps=4,
                tied=tied,
                drain_after=(2, 4),  # a drain in the steady state and at the end, each followed by evaluation
                eval_batches=1,
                lookahead=lookahead,
                **UPDATES[update],
            )


def check(layout: CommLayout, serialized: tuple[bool, ...] = (False,)) -> None:
    """``layout``'s lowering is free of deadlock under each model in ``serialized`` (lowered once)."""
    lowered = programs(layout)
    for strict in serialized:
        try:
            outcome = simulate(lowered, serialized=strict)
        except Deadlock as error:
            raise AssertionError(f"{layout}\n{error}") from None
        assert outcome.steps > 0


FULL_TIER_DEPTHS = (2, 3, 4, 5, 8)  # 6 and 7 (the costliest to lower after 8) in the slow tier's sweep


@pytest.mark.full  # ~40 s: the full tier (the lowering's cases at depth 2 and 4 above stay in make test)
def test_every_schedule_is_deadlock_free_under_nccl():
    """flush, gpipe, zb_h1 and 2bw (2bw and flush also with lookahead 1); depth 2..5 and 8; m = d, d+1 and 16; width 1 and
    2; no clipping, global or per-stage clipping, the non-finite agreement; tied parameters on and off; drains and
    evaluation; each lowering run twice: communicators progressing independently, and kernels one at a time."""
    count = 0
    for layout in sweep(lambda d: sorted({d, d + 1, 16}), FULL_TIER_DEPTHS):
        check(layout, serialized=(False, True))
        count += 1
    # schedules x depths x widths x updates x tied x m
    assert count == len(SCHEDULES) * len(FULL_TIER_DEPTHS) * 2 * len(UPDATES) * 2 * 3


@pytest.mark.slow
def test_every_schedule_is_deadlock_free_under_nccl_every_m():
    """The same for every depth 2..8 and every m in d..16, under both models (a few minutes)."""
    for layout in sweep(lambda d: range(d, 17)):
        check(layout, serialized=(False, True))


def test_the_lowering_sends_one_header_per_boundary_and_phase():
    ops = programs(CommLayout("2bw", 2, 4, steps=3, drain_after=(3,), eval_batches=2))[0]
    headers = [op for op in ops if op.kind == SEND and op.label.endswith("header")]
    assert [op.label for op in headers] == ["SEND_F(m0,v0) header", "EVAL(b0,m0) header"]


def test_a_background_thread_is_a_program_of_its_own():
    """An asynchronous checkpoint's collective on its own group, issued from a thread: recorded between two of the
    main thread's collectives on rank 0 and after both on rank 1. As one program per rank that order deadlocks
    (rank 0 waits in the gather, rank 1 in the second all-reduce); a thread's calls are ordered only by the
    communicators they share, as the real threads are."""
    main = [coll(0, (0, 1), channel="default"), wait(0), coll(1, (0, 1), channel="default"), wait(1)]
    saver = [coll(2, (0, 1), name="gather", channel="checkpoint"), wait(2)]
    recorded = {0: [*main[:2], *saver, *main[2:]], 1: [*main, *saver]}
    with pytest.raises(Deadlock, match="rank 0 blocked at op 3: wait\\(#2\\)"):
        simulate(recorded)
    threaded = {r: [op._replace(thread="saver") if op.handle == 2 else op for op in ops] for r, ops in recorded.items()}
    assert simulate(threaded).steps == 6


def batch_op(kind, h, peer, batch, channel="c"):
    return Op(kind, h, channel, peer, batch=batch)


def test_a_batch_is_one_kernel():
    """1F1B's steady state on one communicator: unbatched, each rank's send waits for a receive queued behind the
    peer's own send (a cycle); batched (one NCCL group each), the two exchanges meet."""
    unbatched = {0: [send(0, 1), recv(1, 1), wait(1)], 1: [send(0, 0), recv(1, 0), wait(1)]}
    with pytest.raises(Deadlock):
        simulate(unbatched)
    batched = {
        0: [batch_op(SEND, 0, 1, 1), batch_op(RECV, 1, 1, 1), wait(0), wait(1)],
        1: [batch_op(SEND, 0, 0, 1), batch_op(RECV, 1, 0, 1), wait(0), wait(1)],
    }
    assert simulate(batched).steps == 4
    assert simulate(batched, serialized=True).steps == 4


def test_serialized_kernels_block_across_communicators():
    """Each direction on its own communicator (this project's previous transport) is free of deadlock while
    communicators progress independently, and deadlocks when kernels run one at a time (``CUDA_DEVICE_MAX_CONNECTIONS
    =1``): rank 0's send, queued first, blocks its receive; rank 1's likewise."""
    programs_ = {
        0: [send(0, 1, "act"), recv(1, 1, "grad"), wait(1)],
        1: [send(0, 0, "grad"), recv(1, 0, "act"), wait(1)],
    }
    simulate(programs_)
    with pytest.raises(Deadlock, match="serialized kernels"):
        simulate(programs_, serialized=True)


def test_a_collective_behind_an_unmatched_send_deadlocks_when_serialized():
    """A pipeline's per-step collective is safe only where no message crosses it: rank 1's send, matched by a
    receive rank 0 posts after the all-reduce, blocks rank 1's all-reduce under serialized kernels."""
    rank0 = [coll(0, (0, 1), channel="g"), wait(0), recv(1, 1), wait(1)]
    rank1 = [send(0, 0), coll(1, (0, 1), channel="g"), wait(1), wait(0)]
    simulate({0: rank0, 1: rank1})
    with pytest.raises(Deadlock):
        simulate({0: rank0, 1: rank1}, serialized=True)


def test_a_gloo_groups_collective_never_blocks_the_device():
    """The stop flag runs on a gloo group over CPU tensors (``STOP_FLAG_GROUP``): posted before a message whose
    partner posts it after a receive, it does not hold the message back under serialized kernels, where the same
    all-reduce on a device communicator (the default group: what the model assumed before) deadlocks."""

    def ranks(channel: str) -> dict[int, list[Op]]:
        rank0 = [coll(0, (0, 1), channel=channel), send(1, 1), wait(1), wait(0)]
        rank1 = [recv(0, 0), wait(0), coll(1, (0, 1), channel=channel), wait(1)]
        return {0: rank0, 1: rank1}

    assert STOP_FLAG_GROUP.endswith(" (host)")
    assert simulate(ranks(STOP_FLAG_GROUP), serialized=True).steps == 4
    with pytest.raises(Deadlock, match="serialized kernels"):
        simulate(ranks("default_pg"), serialized=True)
    lowered = programs(CommLayout("2bw", 2, 2, 1, steps=2))[0]
    flags = {op.channel for op in lowered if op.kind == COLLECTIVE and "sigterm" in op.label}
    assert flags == {STOP_FLAG_GROUP}


@pytest.mark.parametrize("mode", ["flush", "2bw"])
@pytest.mark.parametrize("num_stages", [2, 4])
def test_the_directional_transport_deadlocks_under_serialized_kernels(mode, num_stages):
    """The transport this project had before (a group per direction, receives posted early): free of deadlock while
    communicators progress independently, a hang in both modes once kernels run one at a time."""
    layout = CommLayout(mode, num_stages, num_stages + 2, steps=3)
    simulate(replaced_programs(layout, "directional"))
    with pytest.raises(Deadlock, match="serialized kernels"):
        simulate(replaced_programs(layout, "directional"), serialized=True)


@pytest.mark.slow
def test_every_schedule_is_deadlock_free_under_serialized_kernels_every_m():
    for layout in sweep(lambda d: range(d, 17)):
        check(layout, serialized=(True,))


def held_sends(ops: list[Op]) -> int:
    """The most sends a rank's program has issued and not yet waited for (their buffers are held)."""
    sends, waited, peak = set(), set(), 0
    for op in ops:
        if op.kind == SEND:
            sends.add(op.handle)
        elif op.kind == WAIT:
            waited.add(op.handle)
        peak = max(peak, len(sends - waited))
    return peak


@pytest.mark.parametrize("mode", ["flush", "2bw"])
@pytest.mark.parametrize("num_stages", [2, 4])
def test_sends_held_do_not_grow_with_microbatches(mode, num_stages):
    """A stage holds O(depth) messages: the batched transport waits for its sends to a neighbour once a receive from
    it completes. The directional transport held every send for two segments (2BW: about 2m)."""

    def peak(m, transport):
        layout = CommLayout(mode, num_stages, m, steps=4)
        program = programs(layout) if transport == "batched" else replaced_programs(layout, transport)
        return max(held_sends(ops) for ops in program.values())

    assert peak(4, "batched") == peak(48, "batched") <= num_stages + 2
    assert peak(48, "directional") > 48  # flush: a batch (m) of sends; 2bw: two segments (2m)


def test_sends_are_batched_with_the_receive_the_peer_batches():
    """Every steady-state send goes out in one batch with a receive, and each batch of stage r meets one of stage
    r + 1 with the same two messages in the opposite directions."""
    layout = CommLayout("2bw", 3, 6, steps=4)
    program = programs(layout)

    def batches(rank, peer):
        found = {}
        for op in program[rank]:
            if op.kind in (SEND, RECV) and op.peer == peer and op.batch >= 0:
                found.setdefault(op.batch, []).append(op.kind)
        return [tuple(kinds) for kinds in found.values()]

    for stage in range(2):
        down, up = batches(stage, stage + 1), batches(stage + 1, stage)
        fused_down = [b for b in down if SEND in b and RECV in b]
        fused_up = [b for b in up if SEND in b and RECV in b]
        assert len(fused_down) == len(fused_up) >= layout.steps * layout.num_microbatches - 2 * layout.num_stages


def test_the_lowering_interprets_every_kind_the_engine_does():
    """The lowering dispatches through a ``{Kind: handler}`` table built as the engine's (the executor's compute and
    transport, the update's registered parts, the loss): a kind the engine learns without a lowering fails here,
    a kind the engine has no handler for (or the lowering has and the engine not) too."""
    import torch
    import torch.distributed as dist

    from lightning_pd2bw import PipelineEngine
    from lightning_pd2bw.engine import PipelineOptions

    from ..distributed.launch import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        layers = [torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]
        engine = PipelineEngine(layers, PipelineOptions(num_microbatches=2), lambda b: b, lambda o, b: o.sum())
        engine.start(torch.optim.SGD(engine.parameters(), lr=0.1))
        engine_kinds = set(engine.executor.handlers)
        engine.close()
    finally:
        dist.destroy_process_group()
    lowering = RankProgram(CommLayout("2bw", 2, 2), replica=0, stage=0)
    assert set(lowering.table) == engine_kinds == set(S.TRAIN_KINDS)
    for stage in range(3):  # evaluation's actions: the kinds both interpreters' evaluation tables hold
        assert {a.kind for a in S.evaluation(stage, 3, 2)} <= set(S.EVAL_KINDS)


def test_every_declared_collective_is_waited_after_it_is_issued_on_a_group_the_lowering_knows():
    """Each update part's collectives, for every shape a run can have: issued at an action of the update (or the
    batch's last backward) and waited at the same or a later one, on a communicator the lowering names."""
    from lightning_pd2bw.engine.updates.update import UpdateShape
    from lightning_pd2bw.engine.updates.update_build import collectives

    order = [S.BACKWARD, *S.UPDATE_KINDS]
    lowering = RankProgram(CommLayout("2bw", 2, 2, 2, tied=True), replica=1, stage=1)
    seen = set()
    for double, width, sharded, nonfinite, clip in itertools.product(
        (False, True), (1, 2, 3), (False, True), ("stop", "skip"), (None, "value", "stage", "global")
    ):
        shape = UpdateShape(double, width, 2, True, sharded and width > 1, width > 1, nonfinite, True, clip)
        for part, declared in collectives(shape):
            for collective in declared:
                seen.add(part.__name__)
                lowering.group(collective.group)  # a KeyError names a group the lowering does not know
                waited = collective.issued if collective.waited is None else collective.waited
                assert order.index(collective.issued) <= order.index(waited), (part, collective)
                assert collective.repeat >= 1
    assert seen == {"BucketReducer", "TiedSums", "SkipNonFinite", "GlobalNormClip", "StageNormClip", "Stepper"}


@pytest.mark.parametrize(("mode", "lookahead"), SCHEDULES)
def test_placing_replicas_together_relabels_ranks_and_stays_deadlock_free(mode, lookahead):
    """``placement="replicas"`` (a stage's replicas on consecutive ranks) changes which global rank runs a (stage,
    replica), nothing else: each rank's program is the pipeline placement's program of the same (stage, replica) with
    every peer and member renamed, and the lowering is free of deadlock under both models (depth 2 and 4, width 2,
    sharded gradients, global clipping, the non-finite agreement, tied parameters, drains and evaluation)."""
    from lightning_pd2bw.engine.layout import Placement

    for depth in (2, 4):
        base = dict(steps=4, tied=True, drain_after=(2, 4), eval_batches=1, lookahead=lookahead)
        layout = CommLayout(mode, depth, depth + 1, 2, **base, **UPDATES["sharded_clip_global_skip"])
        by_pipeline = programs(layout)
        replicas = dataclasses.replace(layout, placement=Placement.REPLICAS)
        by_replicas = programs(replicas)
        rename = {  # pipeline placement's rank -> the replicas placement's rank of the same (stage, replica)
            Placement.PIPELINE.rank(s, r, depth, 2): Placement.REPLICAS.rank(s, r, depth, 2)
            for s in range(depth)
            for r in range(2)
        }
        assert sorted(rename.values()) == list(range(2 * depth)) and rename != {r: r for r in rename}
        for rank, ops in by_pipeline.items():
            world = tuple(range(2 * depth))  # the default group: every rank, in rank order under either placement
            moved = [
                op._replace(
                    peer=rename.get(op.peer, op.peer),
                    members=op.members if op.members == world else tuple(rename[m] for m in op.members),
                )
                for op in ops
            ]
            assert by_replicas[rename[rank]] == moved, f"{mode} d={depth}: rank {rank}"
        check(replicas, serialized=(False, True))


@pytest.mark.parametrize("mode", ["2bw", "flush", "zb_h1"])
def test_the_gpt13b_recipes_lowering_is_deadlock_free(mode):
    """Issue 95: the gpt13b recipe's layout as its plan places it (depth 4 x width 16, m = 32, a stage's replicas on
    consecutive ranks), the sharded optimizer with gradients reduced to their owners, global clipping, the tied
    embedding; a synchronous start of 2 steps (a drain after each), a checkpoint drain at step 4 and a validation batch
    after each drain: free of deadlock under NCCL's semantics, communicators independent and kernels serialized."""
    from lightning_pd2bw.engine.layout import Placement

    layout = CommLayout(
        mode,
        4,
        32,
        16,
        steps=5,
        clip="global",
        tied=True,
        drain_after=(1, 2, 4),
        eval_batches=1,
        gradient_buckets=4,
        shard_gradients=True,
        placement=Placement.REPLICAS,
    )
    check(layout, serialized=(False, True))
