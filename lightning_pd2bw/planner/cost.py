"""The cost model: time per batch and memory per stage of one configuration (PipeDream-2BW, 3.3).

A configuration (``Candidate``, ``candidate.py``) is width w, depth d, microbatch size b and recomputation, with
``m = global_batch / (w * b)`` microbatches per batch and replica. Its time per batch is the engine's own per-stage
action lists simulated with a cost per action (``timing.py``, ``simulate.py``): the schedule's forwards, backwards
and boundary messages, the update's parts where the schedule places them, each collective they declare by its
group's topology and bytes. With equal stages and free messages that is m t for 2BW (no bubble) and (m + d - 1) t
for Flush and GPipe, t = F + B (+ F again with recomputation); the simulator also sees what no closed form does:
where the update's collectives wait (the replica all-reduce's cover, the clip norm over the pipeline, the owners'
broadcasts before the next forward), uneven stages, messages on slower links. Memory per stage s:

    weights x versions (2 for 2BW) + gradients x versions (2BW: batch b's set aside until its STEP)
    + optimizer states (of the weights this replica steps: about 1/w of the stage's with ``shard_optimizer``)
    + stash x activations(b)                         (no recomputation)
    + stash x stage input(b) + activations(b)        (recomputation: one microbatch rebuilt at a time)

with stash = min(d - s, m) for 1F1B (2BW, Flush) and m for GPipe; a ``lookahead`` adds that many (at most m - d)
to every stage (``schedule.warmup_forwards``). And every other buffer the engine holds (docs/memory.md;
each term checked against ``PipelineEngine.counters()`` in ``tests/distributed/test_memory.py``):

    correction    2BW's delay correction: one copy of the stage's weights (D(t-1)), and D(t) while it updates
    outputs       the stage's outputs kept for the backward, stash x output (float32 under bf16-mixed: twice
                  the bfloat16 that crosses the boundary)
    transport     boundary messages in flight: (warm-up + 2) outputs to the next stage (its warm-up sends, one
                  batched send, the gradient receive posted with it) and 2 inputs from the previous (one
                  gradient send, one activation receive); never more with m (``transport.py``)
    communication NCCL's buffers: per communicator the stage uses (pipeline neighbours, the pipeline's
                  collectives, the loss broadcast, replicas, tied parameters, the world), by its size, from a
                  public measurement (``candidate.py``); 0 on a CPU
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..engine.layout import Mode
from ..engine.schedules.schedule import warmup_forwards
from ..engine.updates.delay_correction import buffers as correction_buffers
from .candidate import NCCL_GROUP_BYTES, NCCL_PAIR_BYTES, Candidate, ModelProfile
from .hardware import ClusterSpec
from .profile import LayerProfile
from .timing import allreduce_time, compute_time, message_time, timing, update_time

__all__ = [  # the candidate and the timing's pieces are read from here too
    "NCCL_GROUP_BYTES",
    "Candidate",
    "ModelProfile",
    "Prediction",
    "allreduce_time",
    "predict",
    "stage_memory",
]


@dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    num_microbatches: int
    stages: tuple[range, ...]
    stage_times: tuple[float, ...]  # one microbatch, compute and boundary messages
    update_time: float  # per step, what the update (collectives, step, reads) adds: ``simulate.update_added``
    batch_time: float
    stage_memory: tuple[dict[str, float], ...] = field(default_factory=tuple)
    samples_per_batch: int = 0

    @property
    def throughput(self) -> float:
        """Samples per second over the whole cluster."""
        return self.samples_per_batch / self.batch_time

    @property
    def peak_memory(self) -> float:
        return max(sum(m.values()) for m in self.stage_memory)


def stash_count(mode: Mode | str, stage: int, depth: int, num_microbatches: int, lookahead: int = 0) -> int:
    """Microbatches a stage stashes at its peak: its warm-up forwards and the one whose backward comes next."""
    if Mode(mode).forwards_first:
        return num_microbatches
    return min(warmup_forwards(stage, depth, num_microbatches, lookahead) + 1, num_microbatches)


def stage_memory(
    profile: ModelProfile, span: range, stage: int, candidate: Candidate, num_microbatches: int
) -> dict[str, float]:
    layers = [profile.layers[i] for i in span]
    params = sum(p.parameters for p in layers)
    params -= sum(n for a, b, n in profile.shared if a in span and b in span)  # one tensor on this stage
    activations = sum(p.activation_bytes for p in layers)
    largest = max(p.activation_bytes for p in layers)
    recomputed = sum(profile.layers[i].activation_bytes for i in candidate.recomputed(stage, span))
    memory = memory_of(
        profile,
        params,
        activations,
        span.start,
        stage,
        candidate,
        num_microbatches,
        largest,
        candidate.held_states(profile, span),
        recomputed,
        candidate.replica_share(profile, span),
    )
    given = profile.layers[span.start - 1].output_bytes if stage > 0 else 0.0
    memory |= boundary_memory(profile, stage, candidate, num_microbatches, layers[-1], given, span)
    if profile.layer_masks:
        memory["masks"] = sum(profile.layer_masks[i] for i in span)
    return memory


def boundary_memory(
    profile: ModelProfile,
    stage: int,
    candidate: Candidate,
    num_microbatches: int,
    last: LayerProfile,
    given: float,
    span: range | None = None,
) -> dict[str, float]:
    """The stage's outputs kept for the backward, its messages in flight and NCCL's buffers (see the module's
    docstring). ``last``: the stage's last layer (what it sends and keeps per microbatch; nothing on the last
    stage), ``given``: bytes it receives; ``span``: the stage's layers (which tied parameters it shares with
    another stage)."""
    stash = stash_count(candidate.mode, stage, candidate.depth, num_microbatches, candidate.lookahead)
    warmup = stash - 1
    depth = candidate.depth
    sends = stage < depth - 1
    output = last.output_bytes if sends else 0.0
    kept = last.kept_output_bytes if last.kept_output_bytes is not None else output * profile.output_factor
    return {
        "outputs": stash * kept if sends else 0.0,
        "transport": (warmup + 2) * output + 2 * given if depth > 1 else 0.0,
        "communication": communication_bytes(profile, communicators(profile, stage, candidate, span)),
    }


def communicators(profile: ModelProfile, stage: int, candidate: Candidate, span: range | None = None) -> list[int]:
    """The ranks of each NCCL communicator a stage joins (``engine/comm/grid.py`` creates them; NCCL allocates each
    one's buffers at its first use): one per neighbouring stage (``p2p``, a pair), the pipeline's and the loss
    broadcast's (depth > 1), the replicas' and the sharded optimizer's weight broadcasts (width > 1), the tied
    parameters' (only on a stage that holds one another stage holds too: the two stages) and the world's
    (Lightning's barriers and metric gathers)."""
    depth, width = candidate.depth, candidate.width
    tied = (
        any((a in span) != (b in span) and (a in span or b in span) for a, b, _ in profile.shared)
        if span is not None
        else bool(profile.shared)
    )
    sizes = [2] * ((stage > 0) + (stage < depth - 1)) + [depth] * (2 * (depth > 1))
    sizes += [width] * ((width > 1) + (width > 1 and candidate.optimizer_share < 1))
    return sizes + [2] * tied + ([depth * width] if depth * width > 1 else [])


def communication_bytes(profile: ModelProfile, sizes: Sequence[int]) -> float:
    """NCCL's buffers for communicators of ``sizes`` ranks: ``profile.communicator_bytes`` each, a pair's in the
    measured proportion (``candidate.py``)."""
    pair = NCCL_PAIR_BYTES / NCCL_GROUP_BYTES
    return sum(profile.communicator_bytes * (pair if n == 2 else 1.0) for n in sizes if n > 1)


def memory_of(
    profile: ModelProfile,
    params: int,
    activations: float,
    first_layer: int,
    stage: int,
    candidate: Candidate,
    num_microbatches: int,
    largest_layer: float = 0.0,
    states: float | None = None,
    recomputed: float | None = None,
    share: float | None = None,
) -> dict[str, float]:
    """Peak bytes of a stage holding ``params`` parameters whose layers keep ``activations`` per microbatch.

    Besides weights, gradients, optimizer states and the stash: the backward's workspace (gradients of
    one layer's activations, about its saved bytes, ``largest_layer``) and, under 2BW, the optimizer's
    temporaries (a parameter-sized buffer for Adam's foreach step), because 2BW updates while
    microbatches are stashed. Flush and GPipe clear the gradients at each batch, so when the whole
    stash is taken before the first backward (m <= 1F1B's stash) the gradients meet one microbatch fewer.
    ``recomputed``: the activations of the stage's recomputed layers (None: all of them under ``recompute=True``,
    none otherwise); a stashed microbatch keeps their input instead, and the backward rebuilds them one microbatch
    at a time. ``share``: the part of the stage this replica steps (None: ``candidate.optimizer_share``).
    """
    versions = 2 if candidate.mode.double_buffered else 1
    stash = stash_count(candidate.mode, stage, candidate.depth, num_microbatches, candidate.lookahead)
    weights = params * profile.weight_bytes
    per_micro = activations
    if recomputed is None:
        recomputed = activations if candidate.recompute is True else 0.0
    if recomputed:
        stage_input = profile.layers[first_layer - 1].output_bytes if first_layer > 0 else 0.0
        per_micro = stage_input + activations - recomputed
        stashed = stash * per_micro + recomputed
    else:
        stashed = stash * activations
    if candidate.mode.splits_backward:  # zb_h1: stage s holds up to s microbatches' linear inputs and output
        # gradients from their B to their W (bounded here by their activations: the linear maps' inputs and outputs
        # are about 16/17 of a transformer block's); its peak stays stage 0's, 1F1B's (Qi et al. 2024)
        stashed += min(stage, num_microbatches - 1) * (activations - recomputed)
    warmed = stash_count("flush", stage, candidate.depth, num_microbatches, candidate.lookahead)  # 1F1B's stash
    if candidate.mode.flushes and num_microbatches <= warmed:
        stashed = max(stashed - weights, stashed - per_micro)  # gradients arrive as the first microbatch leaves
    # the weights this replica steps (sharded: about 1/w; the fullest replica's, ``Candidate.replica_share``)
    share = (candidate.optimizer_share if share is None else share) * weights
    states = profile.optimizer_states if states is None else states  # per parameter (``ModelProfile.states_of``)
    temporaries = share * profile.temporaries if candidate.mode.double_buffered else 0.0
    held = correction_buffers(candidate.delay_correction)
    in_versions = versions * (weights if profile.version_bytes is None else params * profile.version_bytes)
    sharded_gradients = candidate.shards[1]
    reduce_copy = params * candidate.reduce_bytes(profile) if candidate.width > 1 else 0.0
    master = share if profile.version_bytes is not None else 0.0  # mixed: the float32 masters of the weights it steps
    return {
        "weights": in_versions + master,  # the versions (mixed: in their compute dtype, and the owned masters)
        # 2BW: batch b's, set aside until its STEP, and batch b + 1's (sharded gradients: the owner's share aside)
        # (+ the cast copy the reduce sends where ``grad_reduce_dtype`` differs: every bucket in flight at once)
        "gradients": weights + (versions - 1) * (share if sharded_gradients else weights) + reduce_copy,
        "optimizer": states * share,
        "correction": held * share,  # D(t-1) (and D(t-2)), held between updates, for the weights stepped here
        "activations": stashed,
        "workspace": largest_layer + temporaries + (share if held else 0.0),  # + D(t) while updating
    }


def predict(
    profile: ModelProfile,
    candidate: Candidate,
    cluster: ClusterSpec,
    global_batch: int,
    stages: Sequence[range],
    timed: bool = True,
) -> Prediction:
    """Time (``timing.py``: the engine's actions simulated) and memory of ``candidate`` with the given partition;
    ``timed=False``: the memory alone (its times NaN; what a layout that does not fit needs)."""
    m = candidate.num_microbatches(global_batch)
    times, memory = [], []
    for s, span in enumerate(stages):
        forward, backward = compute_time(profile, candidate, s, span)
        inward = message_time(profile, candidate, cluster, stages, s - 1) if s > 0 else 0.0
        times.append(forward + backward + inward + message_time(profile, candidate, cluster, stages, s))
        memory.append(stage_memory(profile, span, s, candidate, m))
    if not timed:
        nan = float("nan")
        return Prediction(candidate, m, tuple(stages), tuple(times), nan, nan, tuple(memory), global_batch)
    clock = timing(profile, candidate, cluster, stages, m)
    update = update_time(profile, candidate, cluster, stages, m, clock.step_time)
    return Prediction(
        candidate,
        m,
        tuple(stages),
        tuple(times),
        update,
        clock.step_time,
        tuple(memory),
        samples_per_batch=global_batch,
    )
