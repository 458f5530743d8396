"""Search over width, depth, microbatch size and recomputation for the fastest plan that fits.

For each candidate the layers are cut into ``d`` contiguous stages minimising the slowest stage's
time subject to every stage fitting memory (bisection on the bottleneck time, greedy packing as
the feasibility test: exact for contiguous cuts with per-stage monotone limits). Candidates with
``m < d`` are skipped (2BW needs m >= d). A search over 1024 devices takes milliseconds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from ..engine.layout import PLACEMENTS, Mode, Placement, sharded_at
from ..engine.options import PipelineOptions, Run
from ..errors import Refusal
from .candidate import planning_run
from .cost import Candidate, ModelProfile, Prediction, boundary_memory, memory_of, predict, stage_memory
from .hardware import ClusterSpec, GiB
from .timing import compute_time

MEMORY_HEADROOM = 0.9  # allocator fragmentation, CUDA context, communication buffers


class NoPlanFits(Refusal, ValueError):
    """No configuration fits memory; the message says what would."""


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def pack(
    profile: ModelProfile,
    candidate: Candidate,
    num_microbatches: int,
    limit_s: float,
    capacity: float,
    shares: dict[tuple[int, int], float] | None = None,
    held: dict[tuple[int, int, int], float] | None = None,
) -> list[range] | None:
    """Greedy contiguous cut: each stage takes as many layers as fit ``limit_s`` and ``capacity`` (its memory as
    ``cost.stage_memory`` counts it: the fullest replica's optimizer share; ``shares`` caches it per span, ``held``
    the memory of stage s holding layers start..end, which no limit changes)."""
    shares = {} if shares is None else shares
    held = {} if held is None else held
    n, d = len(profile.layers), candidate.depth
    stages, start = [], 0
    for s in range(d):
        last = n if s == d - 1 else n - (d - 1 - s)  # leave a layer for each later stage
        end, time, params, activations, largest = start, 0.0, 0, 0.0, 0.0
        while end < last:
            layer = profile.layers[end]
            again = end in candidate.recomputed(s, range(start, end + 1))  # one of the stage's first, recomputed
            step = layer.forward_s * (2 if again else 1) + layer.backward_s
            if end > start and time + step > limit_s:
                break
            shared = sum(k for a, b, k in profile.shared if b == end and start <= a < end)
            grown = params + layer.parameters - shared, activations + layer.activation_bytes
            widest = max(largest, layer.activation_bytes)
            if (s, start, end) not in held:
                states = candidate.held_states(profile, range(start, end + 1))
                rebuilt = sum(
                    profile.layers[i].activation_bytes for i in candidate.recomputed(s, range(start, end + 1))
                )
                if (start, end) not in shares:  # owners take whole tensors: the fullest replica's share
                    shares[start, end] = candidate.replica_share(profile, range(start, end + 1))
                share = shares[start, end]
                memory = memory_of(
                    profile, grown[0], grown[1], start, s, candidate, num_microbatches, widest, states, rebuilt, share
                )
                given = profile.layers[start - 1].output_bytes if s > 0 else 0.0
                memory |= boundary_memory(profile, s, candidate, num_microbatches, layer, given, range(start, end + 1))
                if profile.layer_masks:  # sparsity masks, one byte per targeted weight
                    memory["masks"] = sum(profile.layer_masks[start : end + 1])
                held[s, start, end] = sum(memory.values())
            if held[s, start, end] > capacity:
                break
            time, (params, activations), largest = time + step, grown, widest
            end += 1
        if end == start or (s == d - 1 and end < n):
            return None
        stages.append(range(start, end))
        start = end
    return stages


def partition(
    profile: ModelProfile, candidate: Candidate, num_microbatches: int, capacity: float
) -> list[range] | None:
    """Contiguous stages minimising the slowest stage's compute time within ``capacity`` bytes."""
    factor = 2 if candidate.recompute else 1  # the bounds of the search (per-stage recomputation lies within)
    steps = [p.forward_s * factor + p.backward_s for p in profile.layers]
    low, high = max(steps) * (1 - 1e-9), sum(steps) * (1 + 1e-9)
    shares: dict[tuple[int, int], float] = {}
    held: dict[tuple[int, int, int], float] = {}
    best = pack(profile, candidate, num_microbatches, high, capacity, shares, held)
    if best is None:
        return None
    for _ in range(40):
        middle = (low + high) / 2
        stages = pack(profile, candidate, num_microbatches, middle, capacity, shares, held)
        if stages is None:
            low = middle
        else:
            high, best = middle, stages
    return best


def fewest_recomputed(
    profile: ModelProfile, candidate: Candidate, num_microbatches: int, capacity: float, stages: Sequence[range]
) -> Candidate | None:
    """``candidate`` on the cut ``stages`` with, per stage, the fewest of its first layers recomputed that make it fit
    ``capacity`` (None: some stage does not fit even recomputing all of its layers). Stage s stashes
    min(d - s + lookahead, m) microbatches, so the first stages need it most and the last ones often not at all."""
    counts = []
    for s, span in enumerate(stages):
        for count in range(len(span) + 1):
            trial = candidate.replaced(recompute=tuple([0] * s + [count] + [0] * (len(stages) - s - 1)))
            if sum(stage_memory(profile, span, s, trial, num_microbatches).values()) <= capacity:
                counts.append(count)
                break
        else:
            return None
    return candidate.replaced(recompute=tuple(counts))


def candidates(
    num_devices: int,
    num_layers: int,
    global_batch: int,
    run: Run | PipelineOptions,
    micro_batch_sizes: Sequence[int] | None = None,
) -> list[Candidate]:
    """Every width x depth x microbatch size x recomputation of ``num_devices`` that runs ``run``'s mode,
    lookahead and delay correction (m >= d). Not 2BW at depth 1 where a pipeline is possible: plain data
    parallelism that would pay the weight delay, the second weight version and the correction's buffers for
    nothing (Flush at depth 1 is the same run without them)."""
    run = run if isinstance(run, Run) else planning_run(run)
    options = run.options
    out = []
    for depth in divisors(num_devices):
        width = num_devices // depth
        if depth > num_layers or global_batch % width:
            continue
        if depth == 1 and Mode(options.mode).double_buffered and num_devices > 1 and num_layers > 1:
            continue
        per_replica = global_batch // width
        for micro in micro_batch_sizes or divisors(per_replica):
            if per_replica % micro or per_replica // micro < depth:
                continue
            for recompute in (False, True):
                for chosen in gradient_choices(options, width):
                    for placed in placement_choices(chosen, width, depth):
                        out.append(Candidate.of(placed, width, depth, micro, recompute, run.precision))
    return out


def placement_choices(options: PipelineOptions, width: int, depth: int) -> list[PipelineOptions]:
    """``options`` as given, or with ``placement`` left to the planner (None) both ways where they differ (width and
    depth > 1): a pipeline's stages on one server, or a stage's replicas (``layout.Placement``)."""
    if options.placement is not None or width == 1 or depth == 1:
        return [options]
    return [options.replace(placement=placement) for placement in PLACEMENTS]


def gradient_choices(options: PipelineOptions, width: int) -> list[PipelineOptions]:
    """``options`` as given, or under 2BW with ``shard_gradients`` left to its default (and the optimizer sharded, at
    width > 1) both ways: reduced to their owners (one gradient buffer, the reduce covered by about one microbatch)
    or all-reduced whole (two buffers, covered by half a batch): the planner weighs memory against the cover."""
    if options.shard_gradients is not None or not Mode(options.mode).double_buffered:
        return [options]
    if not sharded_at(width, options.shard_optimizer):
        return [options]
    return [options.replace(shard_gradients=True), options.replace(shard_gradients=False)]


TIMED_TOO_BIG = 3  # the layouts that do not fit whose time is simulated too (``pd2bw-plan`` shows them)


def search(
    profile_for: Callable[[int], ModelProfile],
    cluster: ClusterSpec,
    global_batch: int,
    options: Run | PipelineOptions | None = None,
    *,
    micro_batch_sizes: Sequence[int] | None = None,
    headroom: float = MEMORY_HEADROOM,
    fastest_only: bool = False,
    predicted: dict[tuple, Prediction] | None = None,
    top: int | None = None,
) -> tuple[list[Prediction], list[Prediction]]:
    """All candidates on ``cluster``'s devices that run ``options`` (a run resolved once, ``planning_run``; options:
    resolved at 32-true; default: ``PipelineOptions()``, the strategy's defaults): (those that fit, fastest first; those that do not, smallest first: the first ``TIMED_TOO_BIG`` timed,
    the rest their memory alone, their times NaN).

    ``profile_for(b)`` returns the model's profile at microbatch size b (called once per size). ``fastest_only``:
    the fastest plan alone is needed (a synchronous schedule's candidates are then simulated from the lowest bound up,
    ``_fastest``); ``top``: the ``top`` fastest are all that is read timed (a table's rows): the others that fit follow
    them untimed (their times NaN), in the order of their bound. ``predicted``: the timed predictions of earlier searches of the same model, cluster and global
    batch, by candidate and cut (filled here). Raises ``NoPlanFits`` when nothing fits, saying what would.
    """
    predicted = {} if predicted is None else predicted

    def timed(candidate: Candidate, stages: Sequence[range]) -> Prediction:
        key = (repr(candidate), tuple((r.start, r.stop) for r in stages))
        if key not in predicted:
            profile = profile_at(candidate.micro_batch_size)
            predicted[key] = predict(profile, candidate, cluster, global_batch, stages)
        return predicted[key]

    capacity = cluster.device.memory_bytes * headroom
    profiles: dict[int, ModelProfile] = {}

    def profile_at(micro: int) -> ModelProfile:
        if micro not in profiles:
            profiles[micro] = profile_for(micro)
        return profiles[micro]

    num_layers = len(profile_at(min(micro_batch_sizes or [1])).layers)
    fits, too_big = [], []
    run = options if isinstance(options, Run) else planning_run(options or PipelineOptions())
    found = candidates(cluster.num_devices, num_layers, global_batch, run, micro_batch_sizes)
    cuts: dict[str, list[range] | None] = {}

    def cut(candidate: Candidate, m: int, limit: float) -> list[range] | None:
        """``partition``, once per candidate whatever its placement (the cut weighs compute and memory only)."""
        shape = (candidate.width, candidate.depth, candidate.micro_batch_size)
        key = repr((shape, candidate.options.replace(placement=None), m, limit))
        if key not in cuts:
            cuts[key] = partition(profile_at(candidate.micro_batch_size), candidate, m, limit)
        return cuts[key]

    fitting: list[tuple[Candidate, list[range]]] = []  # timed below
    for candidate in _shown(found, run.options.mode):
        profile = profile_at(candidate.micro_batch_size)
        m = candidate.num_microbatches(global_batch)
        stages = cut(candidate, m, capacity)
        if stages is not None:
            fitting.append((candidate, stages))
            continue
        stages = cut(candidate, m, float("inf"))  # the time-balanced cut
        fewest = fewest_recomputed(profile, candidate, m, capacity, stages) if candidate.recompute is False else None
        if fewest is not None:  # recomputing some blocks of some stages is enough (Megatron's recompute_num_layers)
            fitting.append((fewest, stages))
        # for the table and the refusal: the time-balanced cut and how much it needs
        too_big.append(predict(profile, candidate, cluster, global_batch, stages, timed=False))
    if (fastest_only or top) and fitting:
        fits = _fastest(fitting, profile_at, global_batch, timed, 1 if fastest_only else top)
        if not fastest_only:  # the rest fit too: untimed, after the fastest
            chosen = {id(p.candidate) for p in fits}
            rest = [(c, stages) for c, stages in fitting if id(c) not in chosen]
            fits += [
                predict(profile_at(c.micro_batch_size), c, cluster, global_batch, st, timed=False) for c, st in rest
            ]
    else:
        fits = [timed(candidate, stages) for candidate, stages in fitting]
        fits.sort(key=lambda p: -p.throughput)
    too_big.sort(key=lambda p: p.peak_memory)
    for i, p in enumerate(too_big[:TIMED_TOO_BIG]):  # the closest, shown beside the plans: timed too
        too_big[i] = timed(p.candidate, p.stages)
    if not fits:
        raise NoPlanFits(refusal(too_big, cluster, capacity, global_batch))
    return fits, too_big


def _fastest(
    fitting: list[tuple[Candidate, list[range]]],
    profile_at: Callable[[int], ModelProfile],
    global_batch: int,
    timed: Callable[[Candidate, Sequence[range]], Prediction],
    keep: int = 1,
) -> list[Prediction]:
    """The fastest of ``fitting``, simulated from the lowest bound up: a step lasts at least its busiest stage's
    compute, ``m`` forwards and backwards (a drained step: the simulator's clock starts every stage at 0; 2BW's: its
    steady state repeats every stage's step, measured after the two that fill the pipeline;
    ``tests/unit/test_search.py`` checks the bound and that the fastest is the exhaustive search's), so a candidate
    whose bound is no faster than the ``keep``-th fastest simulated one cannot displace it. The ``keep`` fastest,
    fastest first."""

    def bound(item: tuple[Candidate, list[range]]) -> float:
        candidate, stages = item
        profile, m = profile_at(candidate.micro_batch_size), candidate.num_microbatches(global_batch)
        return max(m * sum(compute_time(profile, candidate, s, span)) for s, span in enumerate(stages))

    best: list[Prediction] = []
    for seconds, (candidate, stages) in sorted(((bound(item), item) for item in fitting), key=lambda pair: pair[0]):
        if len(best) == keep and seconds >= best[-1].batch_time:
            break
        best = sorted([*best, timed(candidate, stages)], key=lambda p: -p.throughput)[:keep]
    return best


def _shown(found: list[Candidate], mode: str) -> Any:
    """The candidates, with a progress bar on a terminal (a search at 13B takes seconds per mode); as they are
    elsewhere (logs, tests)."""
    import sys

    if not sys.stderr.isatty():
        return found
    from tqdm import tqdm

    return tqdm(found, desc=f"pd2bw-plan: {mode}", unit=" plans", leave=False, file=sys.stderr)


def refusal(too_big: list[Prediction], cluster: ClusterSpec, capacity: float, global_batch: int) -> str:
    if not too_big:
        return (
            f"no configuration exists for {cluster.num_devices} devices and global batch {global_batch}: the "
            "global batch must be divisible by the data-parallel width and give m >= d microbatches; use a global "
            "batch that is a multiple of the device count"
        )
    best = too_big[0]
    c = best.candidate
    need = best.peak_memory
    deepest = max(too_big, key=lambda p: p.candidate.depth).candidate.depth
    hints = []
    if need / capacity * deepest / max(1, c.depth) > 1 or c.depth == deepest:
        hints.append(
            f"more devices (memory per stage shrinks with depth: about {need / capacity:.1f}x the "
            f"{cluster.num_devices} devices)"
        )
    if c.micro_batch_size > 1:
        hints.append("a smaller micro_batch_size (try 1)")
    if not c.recompute:
        hints.append("activation recomputation")
    hints.append("bf16-true weights or SGD instead of AdamW (fewer bytes per parameter)")
    return (
        f"nothing fits {cluster.device.name}'s {capacity / GiB:.1f} GiB usable per device "
        f"({MEMORY_HEADROOM:.0%} of {cluster.device.memory_bytes / GiB:.0f} GiB): the smallest candidate, "
        f"w={c.width} d={c.depth} b={c.micro_batch_size} recompute={c.recompute}, needs {need / GiB:.1f} GiB on its "
        f"largest stage. What would fit: {'; '.join(hints)}"
    )


def format_table(predictions: Sequence[Prediction], limit: int = 10, fits: bool = True) -> str:
    rows = [
        f"{'rank':>4} {'width':>5} {'depth':>5} {'micro':>5} {'m':>4} {'recompute':>9} {'grads':>6} {'ranks':>8} "
        f"{'samples/s':>10} {'batch s':>9} {'update':>6} {'max stage GiB':>13}  stage memory GiB"
    ]  # grads: reduced to their owners or all-reduced whole (shard_gradients); ranks: which are neighbours, a
    # pipeline's stages or a stage's replicas (placement); update: what the update (its collectives, the optimizer's
    # step, the gradient reads) adds to the batch time (``simulate.update_added``)
    for rank, p in enumerate(predictions[:limit], 1):
        c = p.candidate
        per_stage = " ".join(f"{sum(m.values()) / GiB:.1f}" for m in p.stage_memory)
        if len(p.stage_memory) > 8:
            memories = [sum(m.values()) / GiB for m in p.stage_memory]
            per_stage = f"{memories[0]:.1f} ... {memories[-1]:.1f} ({len(memories)} stages)"
        rows.append(
            f"{rank if fits else '-':>4} {c.width:>5} {c.depth:>5} {c.micro_batch_size:>5} {p.num_microbatches:>4} "
            f"{recompute_text(c.recompute):>9} {gradients_text(c):>6} {placement_text(c):>8} {p.throughput:>10.2f} {p.batch_time:>9.3f} "
            f"{100 * p.update_time / p.batch_time:>5.1f}% {p.peak_memory / GiB:>13.1f}  {per_stage}"
        )
    return "\n".join(rows)


def gradients_text(candidate: Candidate) -> str:
    """``owner`` (each gradient reduced to its owner), ``all`` (all-reduced), ``-`` (one replica)."""
    if candidate.width == 1:
        return "-"
    return "owner" if candidate.shards[1] else "all"


def placement_text(candidate: Candidate) -> str:
    """``pipeline`` or ``replicas`` (which ranks share a server), ``-`` where both are the same (width or depth 1)."""
    if candidate.width == 1 or candidate.depth == 1:
        return "-"
    return Placement(candidate.options.placement or Placement.PIPELINE).value


def recompute_text(recompute: bool | tuple[int, ...]) -> str:
    """``on``, ``off``, or the layers each stage recomputes (``3,1,0,0``; long ones shortened)."""
    if isinstance(recompute, bool):
        return "on" if recompute else "off"
    text = ",".join(map(str, recompute))
    return text if len(text) <= 9 else f"{text[:8]}+"
