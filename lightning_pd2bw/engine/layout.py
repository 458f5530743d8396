"""The pipeline's layout: mode, depth, microbatches, width and the stage cut; its rules and defaults, once.

Every check of a layout is here: the schedules (``check_schedule``), the process grid, ``Layout`` (what the
engine is built for), the strategy's constructor and setup, and the Hydra config's cross-field checks call these
functions. Each caller names the settings as its users write them (``Keys``: ``num_stages`` for the engine,
``strategy.num_stages`` for ``pd2bw-train``), so the rule is one and the message speaks the caller's language.
The width (data-parallel replicas) follows from the world size: ``world = num_stages x width``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from torch import nn

from .partition import balanced_partition, layer_parameter_counts


def sharded_at(width: int, enabled: bool) -> bool:
    """Whether sharding over a stage's replicas (``shard_optimizer``, ``shard_gradients``) is in effect: only where
    there are replicas to share with (at width 1 the one replica owns every parameter). The one statement of this
    rule: the engine's shards, the update's shape and the planner's shares read it."""
    return enabled and width > 1


def shards(width: int, shard_optimizer: bool, gradients_to_owners: bool) -> tuple[bool, bool]:
    """At ``width`` replicas: (the optimizer sharded, the gradients reduced to their owners): what ``Run.shards`` and
    the planner's ``Candidate.shards`` read (``gradients_to_owners``: ``PipelineOptions.gradients_to_owners``)."""
    optimizer = sharded_at(width, shard_optimizer)
    return optimizer, optimizer and gradients_to_owners


class Word(str, Enum):
    """A word of the engine's vocabularies (``Mode``, the update's ``CollectiveOp``, ``GroupName``, ...): a ``str``
    that equals, prints and formats as its value, so declarations read as data and a typo fails where it is written
    (``Mode("2bwx")`` raises)."""

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Mode(Word):
    """How the pipeline updates its weights, and the facts every part reads from that (the schedules, the engine, the
    update, the planner), in one place. A ``str``: ``Mode("2bw") == "2bw"``, and it prints as its value."""

    PD2BW = "2bw"  # PipeDream-2BW: no flush; two weight versions; batch b's update first read by batch b+2
    FLUSH = "flush"  # 1F1B with a flush per batch (PipeDream-Flush): one version, exact
    GPIPE = "gpipe"  # all forwards, then all backwards, a flush per batch: one version, exact
    ZB_H1 = "zb_h1"  # zero-bubble H1 (Qi et al. 2024): 1F1B with each backward split into B (the input gradient)
    # and W (the deferred weight gradient), stage s holding s of its W back to fill the cooldown: exact, 1F1B's memory
    INTERLEAVED = "interleaved"  # Megatron's interleaved 1F1B: each rank holds V non-adjacent chunks of the layers
    # (``Layout.virtual_stages``), drained per batch: exact

    @property
    def runs(self) -> bool:
        """Whether the engine runs this mode (every mode does)."""
        return True

    @property
    def interleaved(self) -> bool:
        """Each rank holds ``Layout.virtual_stages`` chunks: virtual stage ``v`` on rank ``v % d``."""
        return self is Mode.INTERLEAVED

    @property
    def double_buffered(self) -> bool:
        """Two weight versions: a batch runs on the version before the newest, so its update may run beside the
        next batch (its delay is what the delay correction corrects)."""
        return self is Mode.PD2BW

    @property
    def flushes(self) -> bool:
        """Every batch drains the pipeline and completes its update before the next batch starts."""
        return not self.double_buffered

    @property
    def forwards_first(self) -> bool:
        """Every forward of a batch before its first backward (no 1F1B, no lookahead)."""
        return self is Mode.GPIPE

    @property
    def splits_backward(self) -> bool:
        """Each backward runs as B (the input gradient, on the critical path) and W (the weight gradients of the
        layers' linear maps, deferred: ``engine/weight_grads.py``)."""
        return self is Mode.ZB_H1


class Placement(Word):
    """Which ranks are neighbours (consecutive ranks share a server): the one statement of where a stage's replica
    sits, read by the process grid, its communicators and the planner's links."""

    PIPELINE = "pipeline"  # a pipeline's stages on consecutive ranks: stage traffic inside a server (rank = r d + s)
    REPLICAS = "replicas"  # a stage's replicas on consecutive ranks (Megatron's data parallelism inside the pipeline
    # parallelism): the gradient reduce inside a server, the boundary messages across servers (rank = s w + r)

    def rank(self, stage: int, replica: int, num_stages: int, width: int) -> int:
        return replica * num_stages + stage if self is Placement.PIPELINE else stage * width + replica

    def position(self, rank: int, num_stages: int, width: int) -> tuple[int, int]:
        """``rank``'s (stage, replica)."""
        return (rank % num_stages, rank // num_stages) if self is Placement.PIPELINE else divmod(rank, width)


PLACEMENTS: tuple[str, ...] = tuple(placement.value for placement in Placement)
MODES: tuple[str, ...] = tuple(mode.value for mode in Mode if mode.runs)  # what a run may name
DEFAULT_MODE = Mode.PD2BW.value  # the strategy's, the engine's and the Hydra schema's default


@dataclass(frozen=True)
class Keys:
    """How a caller names the layout's settings in its messages."""

    where: str = ""  # a prefix naming the caller, e.g. "PipeDream2BWStrategy: "
    call: str = ""  # the other options as a call's argument, e.g. "PipeDream2BWStrategy" -> PipeDream2BWStrategy(k=v)
    prefix: str = ""  # ... or as a dotted key, e.g. "strategy." -> strategy.k=v (when call is empty)
    mode: str = "mode"
    num_stages: str = "num_stages"
    num_microbatches: str = "num_microbatches"
    layers_per_stage: str = "layers_per_stage"
    lookahead: str = "lookahead"
    world: str = "devices x num_nodes"
    more_microbatches: str = "raise num_microbatches to at least {depth} or use fewer stages"

    def named(self, key: str, value: object) -> str:
        """``key=value`` as the caller's users write it."""
        return f"{self.call}({key}={value!r})" if self.call else f"{self.where}{self.prefix}{key}={value!r}"

    def option(self, key: str) -> str:
        """The option itself, e.g. ``PipeDream2BWStrategy(compile=...)`` or ``strategy.compile``."""
        return f"{self.call}({key}=...)" if self.call else f"{self.where}{self.prefix}{key}"


def check_mode(mode: str, keys: Keys = Keys(), planned: bool = False) -> None:
    """``mode`` one the engine runs (``planned``: or one the planner only simulates, ``Mode.runs``)."""
    if mode not in MODES and not (planned and mode in Mode._value2member_map_):
        raise ValueError(f"{keys.where}{keys.mode}={mode!r} is not a mode; valid: {', '.join(MODES)}")


def check_virtual_stages(mode: str, num_stages: int, num_microbatches: int, virtual_stages: int) -> None:
    """Interleaved 1F1B's chunks per rank (>= 2) and its microbatches in rounds of equal size (torch's
    ``ScheduleInterleaved1F1B``: ``max(1, m // d)`` rounds dividing m); one chunk per rank under every other mode."""
    if mode != Mode.INTERLEAVED:
        if virtual_stages != 1:
            raise ValueError(f"virtual_stages={virtual_stages} needs mode='interleaved' (every other mode: 1)")
        return
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 2:
        raise ValueError(f"virtual_stages={virtual_stages!r} is invalid under mode='interleaved': an int >= 2")
    if num_stages < 2:
        raise ValueError("mode='interleaved' needs num_stages >= 2 (its chunks cycle over the stages)")
    rounds = max(1, num_microbatches // num_stages)
    if num_microbatches % rounds:
        raise ValueError(
            f"mode='interleaved' runs its {num_microbatches} microbatches in {rounds} rounds of equal size "
            f"(max(1, m // d) with d={num_stages}): use a num_microbatches that {rounds} divides"
        )


def check_depth(num_stages: int, keys: Keys = Keys()) -> None:
    if num_stages < 1:
        raise ValueError(f"{keys.where}{keys.num_stages}={num_stages} must be >= 1")


def check_microbatches(num_stages: int, num_microbatches: int, keys: Keys = Keys()) -> None:
    """PipeDream-2BW (and 1F1B) need m >= d: fewer microbatches than stages leave stages idle."""
    if num_microbatches < num_stages:
        raise ValueError(
            f"{keys.where}{keys.num_microbatches}={num_microbatches} is smaller than {keys.num_stages}={num_stages} "
            f"({num_microbatches} microbatches per step < {num_stages} stages): the pipeline would idle. It needs "
            f"num_microbatches >= num_stages (PipeDream-2BW's m >= d): {keys.more_microbatches.format(depth=num_stages)}"
        )


def width_of(world_size: int, num_stages: int, keys: Keys = Keys()) -> int:
    """Data-parallel width for ``world_size`` processes, or a clear error."""
    check_depth(num_stages, keys)
    if world_size % num_stages:
        raise ValueError(
            f"{keys.where}world size {world_size} ({keys.world}) is not a multiple of {keys.num_stages}={num_stages}: "
            f"world size = {keys.num_stages} x data-parallel width; use a {keys.num_stages} that divides "
            f"{world_size}, or a world size that is a multiple of {num_stages}"
        )
    return world_size // num_stages


def check_layers(num_layers: int, num_stages: int, keys: Keys = Keys()) -> None:
    if num_layers < num_stages:
        raise ValueError(
            f"{keys.where}the model has {num_layers} pipeline layers but {keys.num_stages}={num_stages}; use at most "
            f"{num_layers} stages or a deeper model"
        )


def check_lookahead(mode: str, lookahead: int, keys: Keys = Keys()) -> None:
    """Extra forwards in flight (``schedule.warmup_forwards``): an int >= 0, for the 1F1B schedules."""
    if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
        raise ValueError(
            f"{keys.where}{keys.lookahead}={lookahead!r} is invalid; valid: an int >= 0 (0: plain 1F1B; 1: one more "
            "forward in flight per stage before the last, one more stashed microbatch each)"
        )
    if lookahead and mode == Mode.GPIPE:
        raise ValueError(
            f"{keys.where}{keys.lookahead}={lookahead} has no meaning under {keys.mode}='gpipe' (all forwards run "
            f"first already); use {keys.mode}='2bw' or 'flush', or {keys.lookahead}=0"
        )
    if lookahead and mode in (Mode.ZB_H1, Mode.INTERLEAVED):
        raise ValueError(
            f"{keys.where}{keys.lookahead}={lookahead} is not supported under {keys.mode}={mode!r} (its deferred "
            f"weight gradients, or its chunks, fill the bubble, not extra forwards); use {keys.lookahead}=0"
        )


def check_schedule(
    mode: str, num_stages: int, num_microbatches: int, keys: Keys = Keys(), lookahead: int = 0, planned: bool = False
) -> None:
    check_mode(mode, keys, planned)
    check_depth(num_stages, keys)
    check_microbatches(num_stages, num_microbatches, keys)
    check_lookahead(mode, lookahead, keys)


def check_pipeline(mode: str, num_stages: int, world_size: int, keys: Keys = Keys()) -> None:
    """2BW at depth 1 over several processes is data parallelism that pays the weight delay, a second weight
    version and the delay correction's buffers for nothing: refused, with the two runs that make sense."""
    if mode == Mode.PD2BW and num_stages == 1 and world_size > 1:
        raise ValueError(
            f"{keys.where}{keys.mode}='2bw' with {keys.num_stages}=1 on {world_size} processes is plain data "
            f"parallelism with 2BW's one-step-stale update and its second weight version, for nothing: use "
            f"{keys.mode}='flush' (the same data parallelism, exact) or {keys.num_stages} >= 2 (a pipeline)"
        )


def ranges_of(layers_per_stage: Sequence[int], num_layers: int, keys: Keys = Keys()) -> list[range]:
    """``[2, 3]`` over 5 layers -> ``[range(0, 2), range(2, 5)]``, or a clear error."""
    if sum(layers_per_stage) != num_layers or min(layers_per_stage) < 1:
        raise ValueError(
            f"{keys.where}{keys.layers_per_stage}={list(layers_per_stage)} must be positive and sum to the model's "
            f"{num_layers} pipeline layers"
        )
    bounds = [0]
    for count in layers_per_stage:
        bounds.append(bounds[-1] + count)
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


@dataclass(frozen=True, init=False)
class Layout:
    """A pipeline's layout, checked when built (``PipelineOptions.resolve(world_size).layout`` resolves one from the options).

    Args:
        num_stages: the depth d.
        num_microbatches: microbatches m per batch and replica (``None``: d; m >= d). Read back, always an ``int``.
        mode: ``"2bw"``, ``"flush"``, ``"zb_h1"`` or ``"gpipe"`` (a ``Mode`` or its value).
        layers_per_stage: the cut, layers per stage (default: balanced by parameter count).
        lookahead: more forwards in flight before the last stage (``schedule.warmup_forwards``; default 0).
        virtual_stages: chunks per rank (``"interleaved"``: default 2, the model cut into d x V chunks, chunk ``v`` on
            rank ``v % d``; every other mode: 1). ``"interleaved"`` is planned, not run (``Mode.runs``).
    """

    num_stages: int
    num_microbatches: int
    mode: Mode
    layers_per_stage: tuple[int, ...] | None
    lookahead: int
    virtual_stages: int

    def __init__(
        self,
        num_stages: int,
        num_microbatches: int | None = None,
        mode: Mode | str = Mode.PD2BW,
        layers_per_stage: Sequence[int] | None = None,
        lookahead: int = 0,
        virtual_stages: int | None = None,
    ) -> None:
        microbatches = num_stages if num_microbatches is None else num_microbatches
        check_schedule(mode, num_stages, microbatches, lookahead=lookahead, planned=True)
        if virtual_stages is None:
            virtual_stages = 2 if mode == Mode.INTERLEAVED else 1
        check_virtual_stages(mode, num_stages, microbatches, virtual_stages)
        cut = None if layers_per_stage is None else tuple(layers_per_stage)
        if cut is not None and len(cut) != num_stages * virtual_stages:
            chunks = f" x virtual_stages={virtual_stages}: one per chunk" if virtual_stages > 1 else ""
            raise ValueError(
                f"layers_per_stage={list(cut)} needs one entry per stage (num_stages={num_stages}{chunks})"
            )
        for name, value in (
            ("num_stages", num_stages),
            ("num_microbatches", microbatches),
            ("mode", Mode(mode)),
            ("layers_per_stage", cut),
            ("lookahead", lookahead),
            ("virtual_stages", virtual_stages),
        ):
            object.__setattr__(self, name, value)

    def cut(self, layers: Sequence[nn.Module]) -> list[range]:
        """Each (virtual) stage's range of layer indices: ``num_stages x virtual_stages`` of them, virtual stage
        ``v`` on stage ``v % num_stages``."""
        chunks = self.num_stages * self.virtual_stages
        check_layers(len(layers), chunks)
        if self.layers_per_stage is not None:
            return ranges_of(self.layers_per_stage, len(layers))
        return balanced_partition(layer_parameter_counts(layers), chunks)

    def chunks(self, stage: int) -> list[int]:
        """The virtual stages ``stage`` holds, in order (its chunks)."""
        return list(range(stage, self.num_stages * self.virtual_stages, self.num_stages))
