"""Interleaved 1F1B (Megatron-LM's virtual pipeline stages, ``Mode.INTERLEAVED``) planned at a synchronous plan's
layout: the comparator ``pd2bw-plan`` prints beside the schedules the engine runs, so a user weighs 2BW against the
best synchronous schedule in use, not only against plain 1F1B.

The candidate's width, depth, microbatch size and options are kept; the model is cut into ``d x V`` chunks balanced
by compute, chunk ``v`` on rank ``v % d``, and the engine's own interleaved actions (``schedule.interleaved_order``)
are simulated with each chunk's costs (``simulate.py``): with equal chunks and free messages its step is
``(m + (d - 1) / V) (F + B)``, 1F1B's bubble divided by V, for V times the boundary messages. Memory per rank: its
chunks' weights, gradients and optimizer states as a stage holding them would, and at its peak
``min((V - 1) P + 2 (d - 1 - r) + 1, V m)`` chunk-microbatches of activations in flight (its warm-up forwards and
the one whose backward comes next; P microbatches a round), each taken as the rank's average chunk; a recomputed
stage (in part or whole) is taken as recomputing every chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..engine.layout import Layout, Mode
from ..engine.partition import balanced_partition
from .cost import Prediction, stage_memory
from .hardware import ClusterSpec
from .simulate import simulate, update_added
from .timing import collective_cost, node_of, stage_costs

VIRTUAL_STAGES = 2  # Megatron's and this mode's default: two chunks a rank
VIRTUAL_CHOICES = (2, 3, 4)  # what ``pd2bw-plan`` weighs

ADDITIVE = ("weights", "gradients", "optimizer", "correction", "masks")  # a rank holds each chunk's in full


def chunks_of(profile, num_chunks: int) -> list[range]:
    """The layers cut into ``num_chunks`` contiguous chunks, balanced by forward and backward time."""
    return balanced_partition([layer.forward_s + layer.backward_s for layer in profile.layers], num_chunks)


def warmup_chunks(rank: int, depth: int, num_microbatches: int, virtual_stages: int) -> int:
    """Interleaved 1F1B's warm-up forwards on ``rank`` (``schedule.interleaved_order``)."""
    per_round = num_microbatches // max(1, num_microbatches // depth)
    return min((virtual_stages - 1) * per_round + 2 * (depth - 1 - rank), virtual_stages * num_microbatches)


def _message_time(profile, candidate, cluster: ClusterSpec, chunks: Sequence[range], v: int) -> float:
    """One boundary message from virtual stage ``v`` to ``v + 1`` (rank ``v % d`` to ``(v + 1) % d``): NVLink where
    every replica's two ranks share a server, else the network link."""
    if v >= len(chunks) - 1:
        return 0.0
    d = candidate.depth
    same = all(
        node_of(candidate, cluster, v % d, r) == node_of(candidate, cluster, (v + 1) % d, r)
        for r in range(candidate.width)
    )
    bandwidth = cluster.intra_node_bandwidth if same else cluster.inter_node_bandwidth
    return cluster.latency + profile.layers[chunks[v].stop - 1].output_bytes / bandwidth


def rank_memory(profile, candidate, chunks: Sequence[range], rank: int, m: int, virtual: int) -> dict[str, float]:
    """Peak bytes of ``rank`` holding its ``virtual`` chunks (see the module's docstring)."""
    d = candidate.depth
    mine = [(v, chunks[v]) for v in range(rank, d * virtual, d)]
    each = [stage_memory(profile, span, rank, candidate, m) for _, span in mine]
    memory = {key: sum(one.get(key, 0.0) for one in each) for key in ADDITIVE if key in each[0]}
    in_flight = warmup_chunks(rank, d, m, virtual) + 1
    recompute = bool(candidate.recompute)
    kept = rebuilt = 0.0
    for v, span in mine:
        activations = sum(profile.layers[i].activation_bytes for i in span)
        given = profile.layers[span.start - 1].output_bytes if span.start > 0 else 0.0
        kept += given if recompute else activations
        if v < d * virtual - 1:
            last = profile.layers[span.stop - 1]
            out = last.kept_output_bytes if last.kept_output_bytes is not None else last.output_bytes
            kept += out * (profile.output_factor if last.kept_output_bytes is None else 1.0)
        rebuilt = max(rebuilt, activations if recompute else 0.0)
    memory["activations"] = in_flight * kept / virtual + rebuilt
    for key in ("workspace", "transport", "communication"):
        memory[key] = max(one.get(key, 0.0) for one in each)
    return memory


def predict_interleaved(
    profile, candidate, cluster: ClusterSpec, global_batch: int, virtual_stages: int = VIRTUAL_STAGES
) -> Prediction | None:
    """``candidate``'s layout run as interleaved 1F1B with ``virtual_stages`` chunks a rank, timed and sized; None
    where it cannot run so (depth 1, fewer layers than chunks, microbatches not in equal rounds)."""
    d, m = candidate.depth, candidate.num_microbatches(global_batch)
    if d == 1 or len(profile.layers) < d * virtual_stages or m % max(1, m // d):
        return None
    if not isinstance(candidate.recompute, bool):  # per stage: taken as every chunk recomputing
        recompute = any(candidate.recompute)
        candidate = candidate.replaced(recompute=recompute)
    chunks = chunks_of(profile, d * virtual_stages)
    ranks = [[i for v in range(r, d * virtual_stages, d) for i in chunks[v]] for r in range(d)]
    costs = [
        stage_costs(
            profile,
            candidate,
            cluster,
            v % d,
            span,
            _message_time(profile, candidate, cluster, chunks, v),
            ranks[v % d],
        )
        for v, span in enumerate(chunks)
    ]
    layout = Layout(d, m, Mode.INTERLEAVED, virtual_stages=virtual_stages)
    cost_of = collective_cost(profile, candidate, cluster, ranks)
    clock = simulate(layout, costs, cost_of)
    memory = tuple(rank_memory(profile, candidate, chunks, r, m, virtual_stages) for r in range(d))
    times = tuple(c.forward + c.backward + c.send for c in costs)
    update = update_added(layout, costs, cost_of, clock.step_time)
    return Prediction(candidate, m, tuple(chunks), times, update, clock.step_time, memory, global_batch)
