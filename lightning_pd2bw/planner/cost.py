"""The cost model: time per batch and memory per stage of one configuration (PipeDream-2BW, 3.3).

A configuration (``Candidate``) is width w, depth d, microbatch size b and recomputation, with
``m = global_batch / (w * b)`` microbatches per batch and replica. Stage s runs one microbatch in

    t_s = F_s + B_s (+ F_s again with recomputation) + boundary messages (latency + bytes / link)

where the link is NVLink inside a server and the network where consecutive ranks straddle servers.
A batch takes, in the steady state,

    2BW:          m * max_s t_s                       (no bubble: the pipeline never drains)
                  + the wait for the clip norm where 3(d - 1) > 2m (``norm_wait``)
    Flush/GPipe:  (m - 1) * max_s t_s + sum_s t_s     (= (m + d - 1) t for equal stages)

plus the update. Flush: the all-reduce of the stage's gradients over its w replicas (ring, on the level of the
topology the replicas span), the sum of shared (tied) parameters' gradients between the stages holding them, and
the optimizer step. 2BW runs its update beside the next batch (``engine/update.py``): only the optimizer's work and
the part of the replica all-reduce longer than a microbatch slot remain. With ``shard_optimizer`` (ZeRO-1) each
replica steps 1/w of the stage's parameters and the owners then broadcast the new weights (an all-gather's bytes,
before the next forward); with ``shard_gradients`` too, the gradients are reduced to their owners (half an
all-reduce's bytes). Memory per stage s:

    weights x versions (2 for 2BW) + gradients x versions (2BW: batch b's set aside until its STEP)
    + optimizer states (of the weights this replica steps: about 1/w of the stage's with ``shard_optimizer``)
    + stash x activations(b)                         (no recomputation)
    + stash x stage input(b) + activations(b)        (recomputation: one microbatch rebuilt at a time)

with stash = min(d - s, m) for 1F1B (2BW, Flush) and m for GPipe; a ``lookahead`` adds that many (at most m - d)
to every stage (``schedule.warmup_forwards``). And every other buffer the engine holds (DESIGN.md, invariant 9;
each term checked against ``PipelineEngine.counters()`` in ``tests/distributed/test_memory.py``):

    correction    2BW's delay correction: one copy of the stage's weights (D(t-1)), and D(t) while it updates
    outputs       the stage's outputs kept for the backward, stash x output (float32 under bf16-mixed: twice
                  the bfloat16 that crosses the boundary)
    transport     boundary messages in flight: (warm-up + 2) outputs to the next stage (its warm-up sends, one
                  batched send, the gradient receive posted with it) and 2 inputs from the previous (one
                  gradient send, one activation receive); never more with m (``transport.py``)
    communication NCCL's buffers: an estimate per communicator the stage uses (pipeline neighbours, the
                  pipeline's collectives, the loss broadcast, replicas, tied parameters), 0 on a CPU
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..engine.delay_correction import buffers as correction_buffers
from ..engine.layout import Mode
from ..engine.options import PipelineOptions, recomputed_layers
from ..engine.schedule import warmup_forwards
from .hardware import ClusterSpec
from .profile import LayerProfile

RECOMPUTE_FACTOR = 1  # recomputation repeats each stage's forward once in its backward
MiB = 1 << 20
# NCCL's own device buffers per communicator: NCCL_BUFFSIZE (4 MiB) for each direction of each of its channels,
# allocated when the communicator is first used. 64 MiB is an estimate (8 channels x 2 x 4 MiB), to be checked
# on each GPU generation (``torch.cuda.mem_get_info`` before and after the first step: docs/gpus.md).
NCCL_BYTES_PER_COMMUNICATOR = 64 * MiB


@dataclass(frozen=True)
class ModelProfile:
    """The layers' profiles at one microbatch size, and what the layers share."""

    layers: Sequence[LayerProfile]
    weight_bytes: int = 4  # per parameter of the weights the optimizer steps (and of the gradients)
    optimizer_states: float = 2  # weight-sized state tensors per parameter (AdamW 2, SGD with momentum 1)
    shared: tuple[tuple[int, int, int], ...] = ()  # (layer a, layer b, parameters) held by both
    output_factor: float = 1.0  # bytes a stage keeps of its output per byte that crosses (2 under bf16-mixed)
    communicator_bytes: float = NCCL_BYTES_PER_COMMUNICATOR  # per communicator (0: gloo, on a CPU)
    # per layer, where optimizers differ by layer (Muon: 1 state for the blocks' matrices, AdamW's 2 for the rest)
    layer_states: tuple[float, ...] = ()
    # weight-sized temporaries of one optimizer step: 1 for foreach AdamW (the CPU), 0 for fused AdamW (CUDA),
    # Muon (one matrix at a time) and SGD; None: 1 for a two-state optimizer
    optimizer_temporaries: float | None = None
    # mixed-precision weights (PipelineOptions.weight_dtype): bytes per parameter of each weight version, held apart
    # from the weights the optimizer steps (one float32 master); None: the versions are those weights
    version_bytes: int | None = None
    # per layer, the bytes of its sparsity masks (one bool per targeted weight; none without sparsity)
    layer_masks: tuple[float, ...] = ()

    def states_of(self, span: range) -> float | None:
        """The optimizer states per parameter of the layers in ``span`` (None: ``optimizer_states``)."""
        if not self.layer_states:
            return None
        params = sum(self.layers[i].parameters for i in span)
        return sum(self.layers[i].parameters * self.layer_states[i] for i in span) / params if params else 0.0

    @property
    def temporaries(self) -> float:
        if self.optimizer_temporaries is not None:
            return self.optimizer_temporaries
        return 1.0 if self.optimizer_states == 2 else 0.0


@dataclass(frozen=True)
class Candidate:
    """One configuration the planner weighs: width, depth, microbatch size and recomputation (the dimensions it
    searches) for the run ``options`` describes, kept whole (its mode, lookahead, delay correction, sharding and
    dtypes; ``Candidate.of``)."""

    width: int
    depth: int
    micro_batch_size: int
    recompute: bool | tuple[int, ...]  # all, none, or per stage its first layers (``PipelineOptions.recompute``)
    options: PipelineOptions = PipelineOptions(delay_correction=None)

    def recomputed(self, stage: int, span: range) -> range:
        """The layers of ``stage`` (its ``span``) that recompute their activations: its first ones."""
        return range(span.start, span.start + recomputed_layers(self.recompute, stage, len(span)))

    @classmethod
    def of(
        cls,
        options: PipelineOptions,
        width: int,
        depth: int,
        micro_batch_size: int,
        recompute: bool | tuple[int, ...] | None = None,
    ) -> Candidate:
        """The candidate that runs with ``options`` (recomputation as the run has it, unless searched): every reader
        of one run (``pd2bw-plan``, the dry run, ``plan="auto"``) plans it through here."""
        recompute = options.recompute if recompute is None else recompute
        layout = dict(num_stages=None, num_microbatches=None, layers_per_stage=None, plan=None, global_batch_size=None)
        return cls(width, depth, micro_batch_size, recompute, options.replace(**layout, recompute=recompute))

    @property
    def mode(self) -> Mode:
        return Mode(self.options.mode)

    @property
    def lookahead(self) -> int:
        """More forwards in flight on every stage (the strategy's ``lookahead``)."""
        return self.options.lookahead

    @property
    def optimizer_share(self) -> float:
        """The part of a stage's optimizer a replica holds and steps: 1/w with ``shard_optimizer`` (ZeRO-1,
        ``engine/sharding.py``; whole tensors, balanced by size, so about 1/w), else all of it."""
        return 1 / self.width if self.options.shard_optimizer and self.width > 1 else 1.0

    @property
    def delay_correction(self) -> str | None:
        """2BW's correction (``engine/delay_correction.py``): its buffers of weights."""
        return self.options.delay_correction if self.mode.double_buffered else None

    def num_microbatches(self, global_batch: int) -> int:
        return global_batch // (self.width * self.micro_batch_size)


@dataclass(frozen=True)
class Prediction:
    candidate: Candidate
    num_microbatches: int
    stages: tuple[range, ...]
    stage_times: tuple[float, ...]  # one microbatch, compute and boundary messages
    update_time: float  # all-reduce + shared sum + optimizer, slowest stage
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
        profile.states_of(span),
        recomputed,
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
    depth, width = candidate.depth, candidate.width
    sends = stage < depth - 1
    output = last.output_bytes if sends else 0.0
    kept = last.kept_output_bytes if last.kept_output_bytes is not None else output * profile.output_factor
    return {
        "outputs": stash * kept if sends else 0.0,
        "transport": (warmup + 2) * output + 2 * given if depth > 1 else 0.0,
        "communication": communicators(profile, stage, candidate, span) * profile.communicator_bytes
        if depth * width > 1
        else 0.0,
    }


def communicators(profile: ModelProfile, stage: int, candidate: Candidate, span: range | None = None) -> int:
    """The NCCL communicators a stage joins (``engine/grid.py`` creates them; NCCL allocates each one's buffers at
    its first use): one per neighbouring stage (``p2p``), the pipeline's and the loss broadcast's (depth > 1), the
    replicas' and the sharded optimizer's weight broadcasts (width > 1), the tied parameters' (only on a stage that
    holds one another stage holds too), and the world's (Lightning's barriers and metric gathers)."""
    depth, width = candidate.depth, candidate.width
    tied = (
        any((a in span) != (b in span) and (a in span or b in span) for a, b, _ in profile.shared)
        if span is not None
        else bool(profile.shared)
    )
    sharded = candidate.optimizer_share < 1
    return (stage > 0) + (stage < depth - 1) + 2 * (depth > 1) + (width > 1) + sharded + tied + 1


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
) -> dict[str, float]:
    """Peak bytes of a stage holding ``params`` parameters whose layers keep ``activations`` per microbatch.

    Besides weights, gradients, optimizer states and the stash: the backward's workspace (gradients of
    one layer's activations, about its saved bytes, ``largest_layer``) and, under 2BW, the optimizer's
    temporaries (a parameter-sized buffer for Adam's foreach step), because 2BW updates while
    microbatches are stashed. Flush and GPipe clear the gradients at each batch, so when the whole
    stash is taken before the first backward (m <= 1F1B's stash) the gradients meet one microbatch fewer.
    ``recomputed``: the activations of the stage's recomputed layers (None: all of them under ``recompute=True``,
    none otherwise); a stashed microbatch keeps their input instead, and the backward rebuilds them one microbatch
    at a time.
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
    warmed = stash_count("flush", stage, candidate.depth, num_microbatches, candidate.lookahead)  # 1F1B's stash
    if candidate.mode.flushes and num_microbatches <= warmed:
        stashed = max(stashed - weights, stashed - per_micro)  # gradients arrive as the first microbatch leaves
    share = candidate.optimizer_share * weights  # the weights this replica steps (sharded: about 1/w)
    states = profile.optimizer_states if states is None else states  # per parameter (``ModelProfile.states_of``)
    temporaries = share * profile.temporaries if candidate.mode.double_buffered else 0.0
    held = correction_buffers(candidate.delay_correction) if candidate.mode.double_buffered else 0
    in_versions = versions * (weights if profile.version_bytes is None else params * profile.version_bytes)
    return {
        "weights": in_versions
        + (
            weights if profile.version_bytes is not None else 0.0
        ),  # the versions (mixed: in their compute dtype, and the master)
        "gradients": versions * weights,  # 2BW: batch b's, set aside until its STEP, and batch b + 1's
        "optimizer": states * share,
        "correction": held * share,  # D(t-1) (and D(t-2)), held between updates, for the weights stepped here
        "activations": stashed,
        "workspace": largest_layer + temporaries + (share if held else 0.0),  # + D(t) while updating
    }


def _crosses_servers(candidate: Candidate, cluster: ClusterSpec, stage: int) -> bool:
    """Does the boundary after ``stage`` join ranks on two servers? (pipelines are consecutive ranks)"""
    per_node = cluster.devices_per_node
    return any(
        (r * candidate.depth + stage) // per_node != (r * candidate.depth + stage + 1) // per_node
        for r in range(candidate.width)
    )


def allreduce_time(num_bytes: float, candidate: Candidate, cluster: ClusterSpec) -> float:
    """Ring all-reduce of one stage's gradients over its w replicas (ranks s, s+d, s+2d, ...).

    Replicas on one server reduce over NVLink; across servers the ring's traffic goes through each
    server's network link, which the stages on that server share (hierarchical all-reduce).
    """
    w = candidate.width
    if w == 1:
        return 0.0
    per_node = cluster.devices_per_node
    nodes = -(-w * candidate.depth // per_node)
    if nodes == 1:
        return 2 * (w - 1) / w * num_bytes / cluster.intra_node_bandwidth + 2 * (w - 1) * cluster.latency
    local = max(1, per_node // candidate.depth)  # replicas of one stage per server
    stages_per_node = min(candidate.depth, per_node)
    intra = 2 * (local - 1) / local * num_bytes / cluster.intra_node_bandwidth if local > 1 else 0.0
    span = -(-w // local)  # servers the ring crosses
    inter = 2 * (span - 1) / span * num_bytes * stages_per_node / cluster.inter_node_bandwidth
    return intra + inter + 2 * (w - 1) * cluster.latency


def norm_wait(depth: int, num_microbatches: int, slowest: float) -> float:
    """2BW's one remaining wait at an update: the first stage clips batch b at the head of step b + 2 by a norm
    the last stage launches once batch b + 1's forward of microbatch (b + 1) m + w0 reached it
    (``schedule.py``); in unit slots (a forward or a backward each) the first stage is there 2m slots after
    b + 1 began, the last stage's launch 3(d - 1) slots after, so it waits where 3(d - 1) > 2m (e.g. d = m = 4:
    one slot). Counted always: the recipes clip by the global norm."""
    return max(0, 3 * (depth - 1) - 2 * num_microbatches) * slowest / 2


def predict(
    profile: ModelProfile,
    candidate: Candidate,
    cluster: ClusterSpec,
    global_batch: int,
    stages: Sequence[range],
) -> Prediction:
    """Time and memory of ``candidate`` with the given partition."""
    m = candidate.num_microbatches(global_batch)
    d = candidate.depth
    times, updates, memory = [], [], []
    for s, span in enumerate(stages):
        layers = [profile.layers[i] for i in span]
        forward = sum(p.forward_s for p in layers)
        again = sum(profile.layers[i].forward_s for i in candidate.recomputed(s, span))  # recomputed in the backward
        compute = forward + sum(p.backward_s for p in layers) + RECOMPUTE_FACTOR * again
        messages = 0.0
        for boundary, crosses in ((s - 1, s > 0), (s, s < d - 1)):
            if crosses:  # activation one way, gradient the other; the sender waits on neither
                link = (
                    cluster.inter_node_bandwidth / min(d, cluster.devices_per_node)
                    if _crosses_servers(candidate, cluster, boundary)
                    else cluster.intra_node_bandwidth
                )
                messages += 2 * cluster.latency + profile.layers[stages[boundary].stop - 1].output_bytes / link
        times.append(compute + messages)
        mem = stage_memory(profile, span, s, candidate, m)
        memory.append(mem)
        grad_bytes = mem["weights"] / (2 if candidate.mode.double_buffered else 1)  # one gradient buffer's bytes
        shared_sum = sum(
            2 * n * profile.weight_bytes / cluster.intra_node_bandwidth
            for a, b, n in profile.shared
            if (a in span) != (b in span) and (a in span or b in span)
        )
        optimizer = sum(p.optimizer_s for p in layers) * candidate.optimizer_share
        replicas = allreduce_time(grad_bytes, candidate, cluster)
        # sharded: the owners' new weights to every replica after the step (an all-gather: half an all-reduce's
        # bytes), before the next forward reads them
        gather = replicas / 2 if candidate.optimizer_share < 1 else 0.0
        if candidate.options.shard_gradients and candidate.optimizer_share < 1:
            replicas /= 2  # each part reduced to its owner alone: a reduce-scatter's bytes, half an all-reduce's
        if candidate.mode.double_buffered:  # beside the next batch: the replica average overlaps the last backward and
            # the next forward, the tied sum a whole partial step; the optimizer's work stays on the device
            updates.append(optimizer + gather + max(0.0, replicas - compute - messages))
        else:
            updates.append(replicas + shared_sum + optimizer + gather)
    slowest = max(times)
    if candidate.mode.double_buffered:
        pipeline = m * slowest + norm_wait(d, m, slowest)
    else:
        pipeline = (m - 1) * slowest + sum(times)
    update = max(updates)
    return Prediction(
        candidate,
        m,
        tuple(stages),
        tuple(times),
        update,
        pipeline + update,
        tuple(memory),
        samples_per_batch=global_batch,
    )
