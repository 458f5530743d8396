"""What the planner weighs: a model's profile (``ModelProfile``: its layers' times and bytes, what they share) and
one configuration of a run (``Candidate``: width, depth, microbatch size and recomputation, with the run's options).
``cost.py`` predicts a candidate's memory and, through ``timing.py``, its time."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from ..engine.layout import Mode
from ..engine.options import PipelineOptions, Run, recomputed_layers
from ..engine.updates.sharding import owners_of
from .profile import LayerProfile

MiB = 1 << 20
MB = 10**6
# NCCL's device memory per communicator, by its size. Each channel keeps, per connection, the three protocols'
# buffers (Simple: NCCL_BUFFSIZE, 4 MiB by default; LL128 ~4.7 MiB; LL 0.5 MiB): 10 MiB in cuMem's 2 MiB granules,
# as NCCL's ALLOC log shows (NVIDIA/nccl#1685); the total is linear in the channels (NCCL_MAX_NCHANNELS lowers it)
# and in the buffer (NCCL_BUFFSIZE). Measured with PyTorch on 4 A100 over NVLink, one all-reduce on each group
# (NVIDIA/nccl#964, 2023): 544 MB for a pair, 688 MB for a larger group (about 52 and 66 connections' buffers).
# Not yet measured by this project: ``torch.cuda.mem_get_info`` before and after the first step (docs/planner.md).
NCCL_GROUP_BYTES = 688 * MB
NCCL_PAIR_BYTES = 544 * MB


@functools.lru_cache(maxsize=4096)
def _fullest_share(sizes: tuple[int, ...], width: int) -> float:
    """The fullest replica's part of tensors of ``sizes`` elements owned as the engine assigns them (a search asks
    for the same stages again and again)."""
    _, load = owners_of(sizes, width)
    return max(load) / sum(sizes)


@functools.lru_cache(maxsize=4096)
def _fullest_states(tensors: tuple[tuple[int, float], ...], width: int) -> float:
    """Optimizer states per parameter of the stage that its fullest replica holds: tensors of (elements, states per
    element) owned as the engine assigns them, by elements (an AdamW embedding beside Muon matrices: its owner holds
    two states where the others hold one)."""
    owners, _ = owners_of([n for n, _ in tensors], width)
    held = [0.0] * width
    for (n, states), owner in zip(tensors, owners):
        held[owner] += n * states
    return max(held) / sum(n for n, _ in tensors)


@dataclass(frozen=True)
class ModelProfile:
    """The layers' profiles at one microbatch size, and what the layers share."""

    layers: Sequence[LayerProfile]
    weight_bytes: int = 4  # per parameter of the weights the optimizer steps (and of the gradients)
    optimizer_states: float = 2  # weight-sized state tensors per parameter (AdamW 2, SGD with momentum 1)
    shared: tuple[tuple[int, int, int], ...] = ()  # (layer a, layer b, parameters) held by both
    output_factor: float = 1.0  # bytes a stage keeps of its output per byte that crosses (2 under bf16-mixed)
    # per NCCL communicator of more than two ranks, a pair's in proportion (0: gloo, on a CPU)
    communicator_bytes: float = NCCL_GROUP_BYTES
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
    # per layer, the elements of each parameter tensor (the sharded optimizer's owners take whole tensors: the fullest
    # replica may step more than 1/w of a stage); none: assumed balanced
    layer_tensors: tuple[tuple[int, ...], ...] = ()

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


def planning_run(options: PipelineOptions, precision: object = None) -> Run:
    """The run ``options`` describe under ``precision``, resolved once (checked, ``"auto"`` dtypes resolved) with its
    layout left to the planner: one process, one stage, recomputation as a choice (all or none), the placement as
    given (None: the planner weighs both); each candidate lays it out (``Candidate.of``). Interleaved 1F1B is planned
    at the other modes' layouts, not searched: refused with where to look."""
    if Mode(options.mode).interleaved:
        raise ValueError(
            "the planner searches layouts for mode=flush, zb_h1 and 2bw; interleaved 1F1B is planned at their best "
            "layouts in the synchronous plans' line (pd2bw-plan strategy.mode=flush shows it): give an interleaved "
            "run its layout (strategy.num_stages, num_microbatches) rather than plan=auto"
        )
    recompute = options.recompute if isinstance(options.recompute, bool) else True
    unlaid = options.replace(num_stages=1, num_microbatches=None, layers_per_stage=None, recompute=recompute)
    run = Run.of(unlaid, 1, precision)
    return replace(run, options=run.options.replace(placement=options.placement))  # None: the planner weighs both


@dataclass(frozen=True)
class Candidate:
    """One configuration the planner weighs: the run laid out at a width and depth, with its recomputation (the
    dimensions it searches; a ``Run``: its options kept whole, dtypes resolved, the width rule its own), and a
    microbatch size."""

    run: Run
    micro_batch_size: int

    @classmethod
    def of(
        cls,
        source: Run | PipelineOptions,
        width: int,
        depth: int,
        micro_batch_size: int,
        recompute: bool | tuple[int, ...] | None = None,
        precision: object = None,
    ) -> Candidate:
        """``source`` (a run, or options resolved under ``precision``) at width x depth, recomputing all, none, or per
        stage its first layers (default: as ``source``): every reader of one run (``pd2bw-plan``, the dry run,
        ``plan="auto"``) plans it through here; ``Run.of`` resolves it."""
        options = source.options if isinstance(source, Run) else source
        precision = source.precision if isinstance(source, Run) else precision
        recompute = options.recompute if recompute is None else recompute
        laid = options.replace(num_stages=depth, num_microbatches=None, layers_per_stage=None, recompute=recompute)
        return cls(Run.of(laid, width * depth, precision), micro_batch_size)

    def replaced(self, **changes: object) -> Candidate:
        """The same width, depth and microbatch size with ``changes`` to the run's options (its mode, recomputation)."""
        return Candidate(
            Run.of(self.options.replace(**changes), self.run.world_size, self.run.precision), self.micro_batch_size
        )

    @property
    def options(self) -> PipelineOptions:
        return self.run.options

    @property
    def width(self) -> int:
        return self.run.width

    @property
    def depth(self) -> int:
        return self.run.num_stages

    @property
    def recompute(self) -> bool | tuple[int, ...]:
        """All, none, or per stage its first layers (``PipelineOptions.recompute``)."""
        return self.options.recompute

    def recomputed(self, stage: int, span: range) -> range:
        """The layers of ``stage`` (its ``span``) that recompute their activations: its first ones."""
        return range(span.start, span.start + recomputed_layers(self.recompute, stage, len(span)))

    @property
    def mode(self) -> Mode:
        return Mode(self.options.mode)

    @property
    def lookahead(self) -> int:
        """More forwards in flight on every stage (the strategy's ``lookahead``)."""
        return self.options.lookahead

    @property
    def shards(self) -> tuple[bool, bool]:
        """(The optimizer sharded, the gradients reduced to their owners) at this width (``Run.shards``)."""
        return self.run.shards

    @property
    def optimizer_share(self) -> float:
        """The part of a stage's optimizer a replica holds and steps: 1/w with ``shard_optimizer`` (ZeRO-1,
        ``engine/updates/sharding.py``; whole tensors, balanced by size, so about 1/w), else all of it."""
        return 1 / self.width if self.shards[0] else 1.0

    def replica_share(self, profile: ModelProfile, span: range) -> float:
        """The part of the stage holding ``span`` that its fullest replica steps: ``optimizer_share``, or with the
        profile's tensor sizes the largest owner's load as the engine assigns owners (``sharding.owners_of``)."""
        share = self.optimizer_share
        if share == 1.0 or not profile.layer_tensors:
            return share
        sizes = tuple(n for i in span for n in profile.layer_tensors[i])
        return _fullest_share(sizes, self.width) if sizes else share

    def held_states(self, profile: ModelProfile, span: range) -> float | None:
        """Optimizer states per parameter of the fullest replica's part (``replica_share``) of the stage holding
        ``span``, its tensors owned as the engine assigns them (None: ``optimizer_states``)."""
        states = profile.states_of(span)
        if states is None or self.optimizer_share == 1.0 or not profile.layer_tensors:
            return states
        tensors = tuple((n, profile.layer_states[i]) for i in span for n in profile.layer_tensors[i])
        return _fullest_states(tensors, self.width) / self.replica_share(profile, span) if tensors else states

    def reduce_bytes(self, profile: ModelProfile) -> int:
        """Bytes per parameter of the cast copy a gradient reduce sends (``grad_reduce_dtype`` other than the
        gradients' own: the engine casts whenever they differ), or 0 where the buckets travel as they are."""
        dtype = self.options.grad_reduce_dtype
        return dtype.itemsize if isinstance(dtype, torch.dtype) and dtype.itemsize != profile.weight_bytes else 0

    @property
    def delay_correction(self) -> str | None:
        """2BW's correction (``engine/updates/delay_correction.py``): its buffers of weights."""
        return self.options.applied_delay_correction

    def num_microbatches(self, global_batch: int) -> int:
        return global_batch // (self.width * self.micro_batch_size)
