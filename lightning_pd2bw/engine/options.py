"""One validated options object for how the pipeline runs, ``PipelineOptions``, and the run it resolves to, ``Run``.

The strategy (``PipeDream2BWStrategy(...)``), the Hydra schema (generated from its fields and the strategy's own,
``lightning/options.py``) and its checks (``pd2bw-train``'s ``strategy.*`` keys, before any process starts) and the
engine (``PipelineEngine(layers, options, ...)``) all build or take this one frozen object, so each option is checked
here only, and each error names the option as that caller's users write it (``Keys``:
``PipeDream2BWStrategy(clip_mode=...)``, ``strategy.clip_mode=...``). These are the engine's options only: the
layout, the compute and the update (its ``Clipping`` included); what the Lightning strategy alone reads (the plan
at start-up, failure timeouts, checkpoints) is ``lightning/options.py``'s ``StrategyOptions``.

``PipelineOptions.resolve(world_size, precision) -> Run`` is the value every reader of a run takes: the options say
what a user asked for (``None``: the default, ``"auto"``: from the precision); a ``Run`` is what runs on
``world_size`` processes under one Lightning precision: the layout with its width w = world / d, and the dtypes with
no ``"auto"`` left. The defaults (d = the world, m = d) and the dtype rule are written here only; every reader takes
them from a ``Run``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import layout as rules
from .compiled import compile_options
from .precision import Precision
from .updates.delay_correction import METHODS as DELAY_CORRECTIONS

CLIP_MODES = ("global", "stage")  # the clip norm over the whole pipeline, or each stage's own
CLIP_ALGORITHMS = ("norm", "value")  # Lightning's gradient_clip_algorithm
NONFINITE_POLICIES = ("stop", "skip")
GROUP_CREATION = ("split", "new_group")  # grid.build_groups
DEFAULT_CORRECTION = "predictive_error_feedback"  # the best measured (docs/quality.md): every entry point's default
DEFAULT_KEYS = rules.Keys(where="PipelineOptions: ", call="PipelineOptions")  # plain PyTorch users build it


@dataclass(frozen=True)
class Clipping:
    """How gradients are clipped before each update (``UpdateShape.clip``: the clipper part the update runs).

    Args:
        value: the threshold; ``None`` or 0: no clipping (Lightning's ``gradient_clip_val``).
        algorithm: ``"norm"`` scales every gradient by ``value / norm`` where the norm exceeds it; ``"value"`` clamps
            each entry to [-value, value] (Lightning's ``gradient_clip_algorithm``).
        mode: for the norm, ``"global"``: the norm over all stages (the single-device model's, one scalar all-reduce
            over the pipeline per update); ``"stage"``: each stage's own (no collective). The strategy's and
            ``pd2bw-train``'s ``clip_mode``.
    """

    value: float | None = None
    algorithm: str = "norm"
    mode: str = "global"

    def __post_init__(self) -> None:
        check_clipping(self.value, self.algorithm, self.mode, lambda name, value: f"Clipping({name}={value!r})")

    @property
    def kind(self) -> str | None:
        """The clipper the update runs: None (off), ``"value"``, or the norm's mode (``"global"``, ``"stage"``)."""
        return None if not self.value else "value" if self.algorithm == "value" else self.mode

    @classmethod
    def of(
        cls, keys: rules.Keys, value: float | None = None, algorithm: str = "norm", mode: str = "global"
    ) -> Clipping:
        """A ``Clipping`` from the flat keys users type: ``clip_mode`` (named as ``keys`` writes it) and the
        Trainer's ``gradient_clip_val`` and ``gradient_clip_algorithm``."""
        trainer = {"value": "gradient_clip_val", "algorithm": "gradient_clip_algorithm"}

        def named(name: str, given: Any) -> str:
            return keys.named("clip_mode", given) if name == "mode" else f"Trainer({trainer[name]}={given!r})"

        check_clipping(value, algorithm, mode, named)
        return cls(value, algorithm, mode)


def check_clipping(value: float | None, algorithm: str, mode: str, named: Callable[[str, Any], str]) -> None:
    """Refuse a bad clipping field; ``named(field, value)`` is how the caller's users write it."""
    if value is not None and not value >= 0:
        raise ValueError(f"{named('value', value)} must be >= 0 (None or 0: no clipping)")
    for name, given, valid in (("algorithm", algorithm, CLIP_ALGORITHMS), ("mode", mode, CLIP_MODES)):
        if given not in valid:
            raise ValueError(f"{named(name, given)} is invalid; valid: {', '.join(valid)}")


@dataclass(frozen=True)
class PipelineOptions:
    """How the pipeline runs. Every field is checked when the object is built; a bad one raises ``ValueError``
    naming it, what is wrong and what is valid. The fields come in three groups: the layout (``num_stages`` to
    ``placement``; under the Lightning strategy the planner's, ``plan="auto"``), the compute (``recompute`` to
    ``compile``) and the update (``clipping`` to ``grad_reduce_dtype``).

    Args:
        num_stages: pipeline depth d (default: the whole world, width 1).
        num_microbatches: microbatches m per batch and replica (default: d); m >= d.
        mode: ``"2bw"`` (double-buffered, no flush), ``"flush"`` (1F1B, drained), ``"zb_h1"``, ``"interleaved"`` (1F1B
            over ``virtual_stages`` chunks a stage, default 2) or ``"gpipe"``.
        lookahead: forwards in flight beyond 1F1B's on every stage but the last (2bw, flush; at most m - d used):
            each one more stashed microbatch per stage, slack between neighbours (0: plain 1F1B).
        virtual_stages: chunks a stage holds under ``"interleaved"`` (None: 2; chunk v on stage v % d).
        layers_per_stage: how many pipeline layers each stage (interleaved: chunk) runs; default: by parameters.
        placement: which ranks are neighbours (consecutive ranks share a server): ``"pipeline"`` (a pipeline's
            stages, rank = replica x d + stage) or ``"replicas"`` (a stage's replicas, rank = stage x w + replica:
            the gradient reduce inside a server, the stages' messages across; Megatron-LM's order). None (the
            default): the planner's choice (``pd2bw-plan``, ``plan="auto"``), else ``"pipeline"`` (``grid.py``).

        recompute: recompute activations in the backward instead of stashing them. ``True``: every layer of every
            stage (a stage stashes only its input per microbatch); ``False``: none; per stage, the number of its
            first layers to recompute (e.g. ``[3, 1, 0, 0]``: Megatron's ``recompute_num_layers`` chosen per stage,
            since stage s stashes min(d - s, m) microbatches: the first stages need it most). The planner
            (``plan="auto"``, ``pd2bw-plan``) chooses the fewest that fit.
        boundary_dtype: the dtype floating-point activations and their gradients cross stage boundaries in.
            ``"auto"``: ``bfloat16`` under ``precision="bf16-mixed"`` (half the bytes on the wire and in the
            receiving stash, Megatron's ``pipeline_dtype``), else each tensor's own; ``None``: each tensor's own
            (bitwise the single-device computation); or a dtype (``torch.bfloat16`` or ``"bfloat16"``).
        weight_dtype: the dtype each weight version is held in for compute, over one float32 master copy that the
            optimizer steps (Megatron's bf16 parameters over fp32 main parameters; ``engine/state/versions.py``): no cast
            of the weights per microbatch, nothing cast stashed, and each microbatch's weight gradient added into
            float32 gradients. ``"auto"``: ``bfloat16`` under ``precision="bf16-mixed"``, else the parameters' own
            dtype; ``None``: the parameters' own dtype (autocast casts them at every forward and recomputation);
            or a dtype. Checkpoints hold the float32 master.
        compile: ``True`` compiles each stage's layers with ``torch.compile`` (per layer, in place); a mapping passes
            its keys to ``torch.compile``. CUDA-graph modes are refused under 2BW. Held as ``None`` or the keywords.

        clipping: how gradients are clipped (``Clipping(value, algorithm, mode)``; default: not at all). The
            Lightning strategy takes the value and the algorithm from the Trainer (``gradient_clip_val``,
            ``gradient_clip_algorithm``) and the mode from its ``clip_mode``; ``from_mapping`` reads the flat
            ``clip_mode`` key.
        on_nonfinite: what a non-finite gradient does: ``"stop"`` (the stage that sees it raises; every rank
            exits, naming it) or ``"skip"`` (all stages agree per batch and skip that update, one scalar
            all-reduce over the pipeline per update; the weights stay as they were, the LR schedule moves on).
        delay_correction: corrects 2BW's one-step delay for any optimizer (``engine/updates/delay_correction.py``):
            ``"predictive_error_feedback"`` (the default: the weights one corrected update ahead; two buffers of the
            stage's weights), ``"error_feedback"`` (one buffer) or ``None`` (the plain rule). No effect under flush.
        delay_correction_strength: ``beta`` of the correction (1.0: first-order extrapolation of the update).
        sync_steps: 2BW's first ``sync_steps`` steps drain after their update (Flush's rule and speed); 0: the paper's
            2BW; ``None`` (default): ``engine/sync_start.py``'s rule at the run's length (the engine alone: 250). A
            checkpoint records the switch step and a resume keeps it. No effect under flush.
        shard_optimizer: with w > 1 replicas, shard the optimizer over them (ZeRO-1, ``engine/updates/sharding.py``): each
            parameter of a stage is owned by one replica (whole tensors, balanced by size), which alone holds its
            optimizer state and the correction's buffers, steps it and broadcasts it: about 1/w of the memory and
            the work. Exact for any optimizer whose step treats each tensor on its own (AdamW, SGD, Muon); turn it
            off for one that couples tensors. No effect at width 1.
        shard_gradients: with the optimizer sharded, reduce each replicated gradient to its owner instead of
            all-reducing it (``grad_buckets.py``; under 2BW one gradient buffer, not two); the hooks see None at the
            parameters other replicas own. ``None`` (the default): on wherever the optimizer is sharded, except beside
            a callback that reads every gradient (RigL: the strategy says so); ``True`` refuses such a callback.
        grad_reduce_dtype: the dtype replicated gradients travel in. None (the default): their own, float32 under
            ``bf16-mixed`` (Megatron-LM's ``grad_reduce_in_fp32``); ``"bfloat16"``: half the bytes, each bucket cast as
            it starts and back where received (the planner counts the copy). No effect at width 1.
        group_creation: how the pipeline's process groups are made under NCCL: ``"split"`` (the default: one
            ``dist.split_group`` of the world per kind of group, where the default group is NCCL bound to a device;
            a ``new_group`` per group elsewhere) or ``"new_group"`` (always; the fallback for a first NCCL run).

        keys: how messages name the options (``PipeDream2BWStrategy(...)``, ``strategy.*``); not an option.
    """

    num_stages: int | None = None
    num_microbatches: int | None = None
    mode: str = rules.DEFAULT_MODE
    lookahead: int = 0
    virtual_stages: int | None = None
    layers_per_stage: tuple[int, ...] | None = None
    placement: str | None = None
    recompute: bool | tuple[int, ...] = False
    boundary_dtype: str | torch.dtype | None = "auto"
    weight_dtype: str | torch.dtype | None = "auto"
    compile: Any = False
    clipping: Clipping = Clipping()
    on_nonfinite: str = "stop"
    delay_correction: str | None = DEFAULT_CORRECTION
    delay_correction_strength: float = 1.0
    sync_steps: int | None = None
    shard_optimizer: bool = True
    shard_gradients: bool | None = None
    grad_reduce_dtype: str | torch.dtype | None = None
    group_creation: str = "split"
    keys: rules.Keys = field(default=DEFAULT_KEYS, compare=False, repr=False)

    @property
    def gradients_to_owners(self) -> bool:
        """``shard_gradients`` resolved (None: as ``shard_optimizer``); in effect only at width > 1."""
        return self.shard_optimizer if self.shard_gradients is None else self.shard_gradients

    def __post_init__(self) -> None:
        keys = self.keys
        rules.check_mode(self.mode, keys)
        rules.check_lookahead(self.mode, self.lookahead, keys)
        if self.num_stages is not None:
            rules.check_depth(self.num_stages, keys)
        if self.num_stages is not None and self.num_microbatches is not None:
            rules.check_microbatches(self.num_stages, self.num_microbatches, keys)
        self._check_cut()
        self._check_recompute()
        if not isinstance(self.clipping, Clipping):
            raise ValueError(
                f"{keys.named('clipping', self.clipping)} is invalid; valid: Clipping(value, algorithm, mode) from "
                "lightning_pd2bw.engine.options"
            )
        self._check_choice("on_nonfinite", NONFINITE_POLICIES)
        self._check_choice("group_creation", GROUP_CREATION)
        if self.placement is not None:
            self._check_choice("placement", rules.PLACEMENTS)
        if self.delay_correction not in (None, *DELAY_CORRECTIONS):
            raise ValueError(
                f"{keys.named('delay_correction', self.delay_correction)} is invalid; valid: None, "
                f"{', '.join(repr(m) for m in DELAY_CORRECTIONS)}"
            )
        if self.sync_steps is not None and not (isinstance(self.sync_steps, int) and self.sync_steps >= 0):
            raise ValueError(
                f"{keys.named('sync_steps', self.sync_steps)} must be an integer >= 0 (0: none) or None (the rule)"
            )
        if not self.delay_correction_strength > 0:
            raise ValueError(
                f"{keys.named('delay_correction_strength', self.delay_correction_strength)} must be > 0 "
                "(1.0: the update extrapolated one step ahead)"
            )
        if self.shard_gradients and not self.shard_optimizer:
            raise ValueError(
                f"{keys.named('shard_gradients', True)} needs the optimizer sharded (the owners the gradients are "
                f"reduced to): set {keys.named('shard_optimizer', True)}, or shard_gradients=False"
            )
        for name in ("boundary_dtype", "weight_dtype"):
            self._set(name, dtype_option(name, getattr(self, name), keys))
        given = self.grad_reduce_dtype
        reduce_dtype = getattr(torch, given, given) if isinstance(given, str) else given
        if reduce_dtype not in (None, torch.float32, torch.bfloat16):
            raise ValueError(
                f"{keys.named('grad_reduce_dtype', given)} is invalid; valid: None (the gradients' own dtype, "
                "float32 under bf16-mixed), 'float32' or 'bfloat16' (half the gradient reduce's bytes)"
            )
        self._set("grad_reduce_dtype", reduce_dtype)
        self._set("compile", compile_options(self.compile, self.mode, keys.option("compile")))

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # a normalised form of what was given (frozen otherwise)

    def _check_choice(self, name: str, valid: tuple[str, ...]) -> None:
        if getattr(self, name) not in valid:
            raise ValueError(f"{self.keys.named(name, getattr(self, name))} is invalid; valid: {', '.join(valid)}")

    def _check_recompute(self) -> None:
        value = self.recompute
        if isinstance(value, bool):
            return
        counts = tuple(value) if isinstance(value, Sequence) and not isinstance(value, str) else None
        if counts is None or not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
            raise ValueError(
                f"{self.keys.named('recompute', value)} is invalid; valid: true, false, or per stage the number of "
                "its first layers to recompute (e.g. [2, 1, 0, 0])"
            )
        if self.num_stages is not None and len(counts) != self.num_stages:
            raise ValueError(
                f"{self.keys.named('recompute', list(counts))} needs one entry per stage ({self.keys.num_stages}="
                f"{self.num_stages})"
            )
        self._set("recompute", counts)

    def _check_cut(self) -> None:
        if self.layers_per_stage is not None:
            self._set("layers_per_stage", tuple(self.layers_per_stage))
            if len(self.layers_per_stage) != (self.num_stages or 0) * self.chunks:
                raise ValueError(
                    f"{self.keys.named('layers_per_stage', list(self.layers_per_stage))} needs one entry per stage "
                    f"(under mode='interleaved' one per chunk, {self.chunks} a stage): give num_stages to match"
                )

    @property
    def chunks(self) -> int:
        """Chunks a stage holds: ``virtual_stages`` under interleaved 1F1B (default 2), else 1."""
        return (self.virtual_stages or 2) if self.mode == "interleaved" else (self.virtual_stages or 1)

    @property
    def applied_delay_correction(self) -> str | None:
        """The correction the run applies: ``delay_correction`` under 2BW, None under Flush (no delay to correct):
        what the engine builds, the planner counts and the memory advice offers to drop."""
        return self.delay_correction if rules.Mode(self.mode).double_buffered else None

    def resolve(self, world_size: int, precision: str | None = None) -> Run:
        """The ``Run`` these options give on ``world_size`` processes under a Lightning ``precision`` (depth: the
        world, by default; microbatches: the depth; ``"auto"`` dtypes: bfloat16 under ``"bf16-mixed"``, else the
        tensors' own)."""
        return Run.of(self, world_size, precision)

    def layout(self, world_size: int) -> rules.Layout:
        """The ``Layout`` these options give on ``world_size`` processes (``resolve(world_size).layout``)."""
        return self.resolve(world_size).layout

    def replace(self, **changes: Any) -> PipelineOptions:
        """A copy with ``changes`` (checked again), e.g. the planner's depth and recomputation."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The flat keys users type (``clip_mode`` for ``clipping``'s mode), in the fields' order."""
        return tuple(FLAT_KEYS.get(f.name, f.name) for f in dataclasses.fields(cls) if f.name != "keys")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], keys: rules.Keys = DEFAULT_KEYS) -> PipelineOptions:
        """The options among the flat ``values`` (e.g. a Hydra ``strategy`` node; other keys are left out)."""
        given = {name: values[name] for name in cls.names() if name in values}
        if "clip_mode" in given:
            given["clipping"] = Clipping.of(keys, mode=given.pop("clip_mode"))
        return cls(**given, keys=keys)


FLAT_KEYS = {"clipping": "clip_mode"}  # a field held as a value -> the key users type for it


def dtype_option(
    name: str, value: str | torch.dtype | None, keys: rules.Keys = DEFAULT_KEYS
) -> str | torch.dtype | None:
    """``"auto"``, None, or a floating-point dtype given as a ``torch.dtype`` or its name (``"bfloat16"``)."""
    if value in (None, "auto"):
        return value
    dtype = getattr(torch, value, None) if isinstance(value, str) else value
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(
            f"{keys.named(name, value)} is invalid; valid: 'auto', None or a floating-point "
            "dtype (torch.bfloat16 or 'bfloat16', 'float16', 'float32')"
        )
    return dtype


def _resolved_dtypes(options: PipelineOptions, precision: object) -> dict[str, torch.dtype | None]:
    """``weight_dtype`` and ``boundary_dtype`` with ``"auto"`` resolved under ``precision`` (``engine/precision.py``)."""
    resolve = Precision.of(precision).resolve
    return {name: resolve(getattr(options, name)) for name in ("weight_dtype", "boundary_dtype")}


@dataclass(frozen=True)
class Run:
    """A run resolved on ``world_size`` processes: the options (depth, microbatches, ``"auto"`` dtypes resolved:
    ``weight_dtype`` the versions' over a float32 master, ``boundary_dtype`` the activations'), layout and width."""

    options: PipelineOptions
    layout: rules.Layout
    world_size: int
    precision: Precision = Precision()

    @classmethod
    def of(cls, options: PipelineOptions, world_size: int, precision: str | None = None) -> Run:
        keys = options.keys
        depth = options.num_stages or world_size
        rules.width_of(world_size, depth, keys)
        rules.check_pipeline(options.mode, depth, world_size, keys)
        microbatches = options.num_microbatches or depth
        if isinstance(options.recompute, tuple) and len(options.recompute) != depth:
            raise ValueError(
                f"{keys.named('recompute', list(options.recompute))} needs one entry per stage: {depth} stages here"
            )
        layout = rules.Layout(
            depth, microbatches, options.mode, options.layers_per_stage, options.lookahead, options.chunks
        )
        resolved = options.replace(
            num_stages=depth,
            num_microbatches=microbatches,
            placement=options.placement or rules.Placement.PIPELINE.value,
            **_resolved_dtypes(options, precision),
        )
        return cls(resolved, layout, world_size, Precision.of(precision))

    @property
    def weight_dtype(self) -> torch.dtype | None:
        return self.options.weight_dtype  # type: ignore[return-value]

    @property
    def boundary_dtype(self) -> torch.dtype | None:
        return self.options.boundary_dtype  # type: ignore[return-value]

    @property
    def width(self) -> int:
        """Data-parallel replicas of the pipeline: world / depth."""
        return self.world_size // self.layout.num_stages

    @property
    def shards(self) -> tuple[bool, bool]:  # (the optimizer sharded, the gradients to their owners): layout.shards
        return rules.shards(self.width, self.options.shard_optimizer, self.options.gradients_to_owners)

    @property
    def num_stages(self) -> int:
        return self.layout.num_stages

    @property
    def num_microbatches(self) -> int:
        return self.layout.num_microbatches

    @property
    def mode(self) -> rules.Mode:
        return self.layout.mode


def recomputed_layers(recompute: bool | tuple[int, ...], stage: int, num_layers: int) -> int:
    """How many of ``stage``'s first layers (of its ``num_layers``) recompute their activations in the backward."""
    if isinstance(recompute, bool):
        return num_layers if recompute else 0
    return min(recompute[stage], num_layers)
