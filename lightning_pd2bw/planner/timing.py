"""What each of the engine's actions costs on a cluster, and the step time of a candidate: the simulator
(``simulate.py``) run over the engine's own action lists with these costs.

Per stage: a forward and a backward per microbatch (with the recomputed layers' forward again), one boundary message
each way per microbatch (latency + bytes over NVLink inside a server, or the server's network link shared by the
stages on it), the optimizer's step over the weights this replica steps, and the gradients read once each for the
non-finite flags and the clip norm (at the device's memory bandwidth). Per collective the update's parts declare
(``update_parts.py``): the replica all-reduce of the gradients (ring, on the level of the topology the replicas
span; split in ``gradients.replica_bucket_bytes`` buckets; with ``shard_gradients`` each bucket reduced to its owners, half
the bytes), the tied parameters' replica average and their sum between the stages holding them, the scalar sums
over the pipeline and the shard group, and the sharded optimizer's owners' broadcasts (an all-gather's bytes in
all; in the weight versions' dtype under mixed weights). The planner assumes the recipes' clipping by the global norm.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from ..engine.layout import Layout, Placement
from ..engine.schedules import schedule as S
from ..engine.updates.collectives import Collective, CollectiveOp, GroupName
from ..engine.updates.gradients import replica_bucket_bytes
from ..engine.updates.update import UpdateShape
from .candidate import Candidate, ModelProfile
from .hardware import ClusterSpec
from .simulate import CollectiveCost, StageCosts, Timing, simulate, update_added, without_update_compute

RECOMPUTE_FACTOR = 1  # recomputation repeats each stage's forward once in its backward


def node_of(candidate: Candidate, cluster: ClusterSpec, stage: int, replica: int) -> int:
    """The server running ``stage`` of ``replica`` (consecutive ranks share a server; ``layout.Placement`` says which
    ranks are consecutive: a pipeline's stages, the default, or a stage's replicas)."""
    placement = Placement(candidate.options.placement or Placement.PIPELINE)
    return placement.rank(stage, replica, candidate.depth, candidate.width) // cluster.devices_per_node


def crosses_servers(candidate: Candidate, cluster: ClusterSpec, stage: int) -> bool:
    """Does the boundary after ``stage`` join ranks on two servers?"""
    return any(
        node_of(candidate, cluster, stage, r) != node_of(candidate, cluster, stage + 1, r)
        for r in range(candidate.width)
    )


def allreduce_time(num_bytes: float, candidate: Candidate, cluster: ClusterSpec) -> float:
    """Ring all-reduce of one stage's gradients over its w replicas (every stage's replicas are placed alike).

    Replicas on one server reduce over NVLink; across servers the ring's traffic goes through each
    server's network link, which the stages on that server share (hierarchical all-reduce).
    """
    w = candidate.width
    if w == 1:
        return 0.0
    nodes = [node_of(candidate, cluster, 0, r) for r in range(w)]
    if len(set(nodes)) == 1:
        return 2 * (w - 1) / w * num_bytes / cluster.intra_node_bandwidth + 2 * (w - 1) * cluster.latency
    local = nodes.count(nodes[0])  # replicas of one stage per server
    per_node, placement = cluster.devices_per_node, Placement(candidate.options.placement or Placement.PIPELINE)
    on_server = range(nodes[0] * per_node, min((nodes[0] + 1) * per_node, candidate.depth * w))
    # the stages whose reduces share that server's network link
    stages_per_node = len({placement.position(rank, candidate.depth, w)[0] for rank in on_server})
    intra = 2 * (local - 1) / local * num_bytes / cluster.intra_node_bandwidth if local > 1 else 0.0
    span = len(set(nodes))  # servers the ring crosses
    inter = 2 * (span - 1) / span * num_bytes * stages_per_node / cluster.inter_node_bandwidth
    return intra + inter + 2 * (w - 1) * cluster.latency


def link_bandwidth(candidate: Candidate, cluster: ClusterSpec, boundary: int) -> float:
    """Bytes/s of the link after stage ``boundary``: NVLink inside a server, else the server's network link, shared
    by every pipeline boundary that leaves the same server (a pipeline deeper than a server, by pipeline, leaves
    each of its servers once; by replicas, every replica's boundary leaves the server at once)."""
    if not crosses_servers(candidate, cluster, boundary):
        return cluster.intra_node_bandwidth
    node = lambda s, r: node_of(candidate, cluster, s, r)  # noqa: E731
    leaving = [
        (s, r) for r in range(candidate.width) for s in range(candidate.depth - 1) if node(s, r) != node(s + 1, r)
    ]
    here = next(node(s, r) for s, r in leaving if s == boundary)
    return cluster.inter_node_bandwidth / sum(node(s, r) == here for s, r in leaving)


def compute_time(profile: ModelProfile, candidate: Candidate, stage: int, span: range) -> tuple[float, float]:
    """(forward, backward with recomputation) of one microbatch on ``stage``."""
    forward = sum(profile.layers[i].forward_s for i in span)
    again = sum(profile.layers[i].forward_s for i in candidate.recomputed(stage, span))
    return forward, sum(profile.layers[i].backward_s for i in span) + RECOMPUTE_FACTOR * again


def weight_grad_time(profile: ModelProfile, candidate: Candidate, stage: int, span: range) -> float:
    """Of the backward, what a split (``zb_h1``) defers to W on ``stage``: its layers' weight gradients, except the
    recomputed layers' (they run undivided: ``engine/weight_grads.py``); 0 under the other modes."""
    if not candidate.mode.splits_backward:
        return 0.0
    recomputed = set(candidate.recomputed(stage, span))
    return sum(profile.layers[i].weight_grad_s for i in span if i not in recomputed)


def message_time(
    profile: ModelProfile, candidate: Candidate, cluster: ClusterSpec, stages: Sequence[range], s: int
) -> float:
    """One boundary message from stage ``s`` to ``s + 1`` (its output; the gradient back is as large)."""
    if s >= candidate.depth - 1:
        return 0.0
    output = profile.layers[stages[s].stop - 1].output_bytes
    return cluster.latency + output / link_bandwidth(candidate, cluster, s)


def tied_parameters(profile: ModelProfile, span: range) -> int:
    """Parameters of ``span`` another stage holds too (a tied embedding)."""
    return sum(n for a, b, n in profile.shared if (a in span) != (b in span) and (a in span or b in span))


def update_shape(profile: ModelProfile, candidate: Candidate, span: range) -> UpdateShape:
    """The update of a stage holding ``span`` in ``candidate`` (``update_build.choose_parts`` reads it)."""
    options, width = candidate.options, candidate.width
    replicated = (
        sum(profile.layers[i].parameters for i in span) - tied_parameters(profile, span)
    ) * profile.weight_bytes
    return UpdateShape.of(
        options.mode,
        width,
        shard_optimizer=options.shard_optimizer,
        shard_gradients=options.gradients_to_owners,
        nonfinite=options.on_nonfinite,
        clip=options.clipping.kind or options.clipping.mode,  # no value given (the Trainer's): by the norm, as recipes
        buckets=max(1, math.ceil(replicated / replica_bucket_bytes(width, profile.weight_bytes))),
        tied=tied_parameters(profile, span) > 0,
    )


def collective_cost(
    profile: ModelProfile, candidate: Candidate, cluster: ClusterSpec, stages: Sequence[range]
) -> CollectiveCost:
    """Seconds of one issue of each collective a stage's update declares."""

    def cost(stage: int, collective: Collective) -> float:
        span = stages[stage]
        shape = update_shape(profile, candidate, span)
        params = sum(profile.layers[i].parameters for i in span)
        tied = tied_parameters(profile, span) * profile.weight_bytes
        travels = candidate.reduce_bytes(profile) or profile.weight_bytes  # per parameter (``grad_reduce_dtype``)
        replicated = (params * profile.weight_bytes - tied) / max(1, shape.buckets) * travels / profile.weight_bytes
        if collective.group is GroupName.REPLICA and collective.issued == S.BACKWARD:  # one bucket (or an owner's part)
            whole = allreduce_time(replicated, candidate, cluster)
            return whole / 2 / shape.width if collective.op is CollectiveOp.REDUCE else whole
        if collective.group is GroupName.REPLICA:  # the tied parameters' replica average
            return allreduce_time(tied, candidate, cluster)
        if collective.group is GroupName.TIED:  # between the first and the last stage
            same_server = node_of(candidate, cluster, 0, 0) == node_of(candidate, cluster, candidate.depth - 1, 0)
            return cluster.latency + tied / (
                cluster.intra_node_bandwidth if same_server else cluster.inter_node_bandwidth
            )
        if collective.op is CollectiveOp.BROADCAST:  # one owner's new weights to every replica (mixed: bf16)
            sent = profile.version_bytes or profile.weight_bytes
            return allreduce_time(params * sent, candidate, cluster) / 2 / shape.width
        return 2 * cluster.latency  # a scalar: a flag, a norm

    return cost


def stage_costs(
    profile: ModelProfile,
    candidate: Candidate,
    cluster: ClusterSpec,
    stage: int,
    span: Sequence[int],
    send: float,
    update_span: Sequence[int] | None = None,
) -> StageCosts:
    """What the simulator charges (virtual) stage ``stage`` holding ``span``: its compute, ``send`` per boundary
    message, its optimizer step and gradient reads (at the memory bandwidth; 0 where unknown: a CPU) and its update's
    shape (``update_span``: the layers the update covers, interleaved 1F1B's whole stage; default ``span``)."""
    forward, backward = compute_time(profile, candidate, stage, span)
    bandwidth = cluster.device.memory_bandwidth
    params = sum(profile.layers[i].parameters for i in span)
    return StageCosts(
        forward,
        backward,
        send=send,
        step=sum(profile.layers[i].optimizer_s for i in span) * candidate.replica_share(profile, span),
        read_gradients=params * profile.weight_bytes / bandwidth if bandwidth else 0.0,
        shape=update_shape(profile, candidate, span if update_span is None else update_span),
        weight_grad=weight_grad_time(profile, candidate, stage, span),
    )


def timing(
    profile: ModelProfile,
    candidate: Candidate,
    cluster: ClusterSpec,
    stages: Sequence[range],
    num_microbatches: int,
    free: Callable[[Collective], bool] | None = None,
    synchronous: bool = False,
    free_compute: bool = False,
) -> Timing:
    """The steady-state step of ``candidate`` cut as ``stages``, simulated over the engine's actions (``free``: the
    collectives that cost nothing, to see what the others add; ``free_compute``: the optimizer's step and the gradient
    reads cost nothing; ``synchronous``: a step of 2BW's synchronous start)."""
    layout, costs, cost = _priced(profile, candidate, cluster, stages, num_microbatches)
    costs = without_update_compute(costs) if free_compute else costs
    return simulate(
        layout, costs, cost if free is None else lambda s, c: 0.0 if free(c) else cost(s, c), None, synchronous
    )


def update_time(
    profile: ModelProfile,
    candidate: Candidate,
    cluster: ClusterSpec,
    stages: Sequence[range],
    num_microbatches: int,
    step_time: float,
) -> float:
    """What the update adds to ``step_time``, the candidate's step (``simulate.update_added``)."""
    return update_added(*_priced(profile, candidate, cluster, stages, num_microbatches), step_time)


def _priced(
    profile: ModelProfile, candidate: Candidate, cluster: ClusterSpec, stages: Sequence[range], num_microbatches: int
) -> tuple[Layout, list[StageCosts], CollectiveCost]:
    """The layout the simulator runs, each stage's costs and the collectives' prices."""
    costs = [
        stage_costs(profile, candidate, cluster, s, span, message_time(profile, candidate, cluster, stages, s))
        for s, span in enumerate(stages)
    ]
    layout = Layout(candidate.depth, num_microbatches, candidate.options.mode, lookahead=candidate.lookahead)
    return layout, costs, collective_cost(profile, candidate, cluster, stages)


# what ``update_cost`` splits the update's collectives into
UPDATE_COLLECTIVES: dict[str, Callable[[Collective], bool]] = {
    "gradient reduce": lambda c: c.group is GroupName.REPLICA and c.issued == S.BACKWARD,
    "weight broadcasts": lambda c: c.op is CollectiveOp.BROADCAST,
    "tied weights": lambda c: c.group is GroupName.TIED or (c.group is GroupName.REPLICA and c.issued != S.BACKWARD),
}


def update_cost(
    profile: ModelProfile, candidate: Candidate, cluster: ClusterSpec, stages: Sequence[range], num_microbatches: int
) -> dict[str, float]:
    """Seconds the update adds to the step (``step``: the step simulated; ``all``: what it loses to the whole update,
    its collectives and its compute; per ``UPDATE_COLLECTIVES`` entry, what that kind alone adds over the step
    without it; ``optimizer step and reads``: the compute alone). Unlike a stage's time blocked on collectives
    (``Timing.exposed``), this leaves out the pipeline's own bubble: a stage's wait for the global norm while the
    others finish their cool-down costs the step nothing."""
    step = timing(profile, candidate, cluster, stages, num_microbatches).step_time
    added = {"step": step}
    added["all"] = update_time(profile, candidate, cluster, stages, num_microbatches, step)
    for name, kind in UPDATE_COLLECTIVES.items():
        added[name] = step - timing(profile, candidate, cluster, stages, num_microbatches, free=kind).step_time
    compute = timing(profile, candidate, cluster, stages, num_microbatches, free_compute=True)
    added["optimizer step and reads"] = step - compute.step_time
    return added
