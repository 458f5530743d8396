"""Runs one stage's actions: microbatches in, activations and gradients across the link, updates.

The executor interprets any schedule from ``schedule.py``, lowered (``lowering.lower``: the ops the NCCL model checks
and the planner's simulator times), through one ``{Kind: handler}`` table (as DeepSpeed's instruction map and
``torch.distributed.pipelining``'s schedules do): its own compute and transport handlers, plus the update's parts and
the loss, handed to it at construction (``handlers``: ``update.UpdateRule.handlers()`` and
``ledger.LossBroadcast``; ``parts``: the update's declared parts, ``update_build.collectives``). Each handler gets
the action's ``lowering.Op``. It knows nothing of Lightning. The caller feeds microbatches and hands it the actions
of a step.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .comm.transport import StageLink, as_tuple, carries_gradient, input_signature
from .interleaving import lockstep_handlers
from .layout import Layout
from .observer import ActionRecorder, SavedTensorMeter, pack_alias, stash_nbytes, unpack_alias
from .options import PipelineOptions, recomputed_layers
from .schedules import schedule as S
from .schedules.lowering import Op, Parts, lower
from .state.ledger import BatchLedger
from .state.versions import WeightVersions
from .weight_grads import WeightGradients


def add_note(error: BaseException, note: str) -> None:
    """Shown under the error's traceback (Python >= 3.11); printed at once on older versions."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:
        import sys

        print(note, file=sys.stderr, flush=True)


_MIXED_WEIGHTS_HINT = (
    "pd2bw: the layers run on {dtype} weight versions (weight_dtype='auto' under bf16-mixed: no cast per "
    "microbatch); a layer that mixes them with float32 tensors (e.g. a float32 input to a norm on the CPU) fails "
    "so. Cast that input, or keep float32 weights cast by autocast: {option}"
)


class StageExecutor:
    """One pipeline stage: its layers, its link to the neighbours, its weight versions."""

    def __init__(
        self,
        layers: Sequence[nn.Module],
        stage: int,
        layout: Layout,
        link: StageLink,
        versions: WeightVersions,
        input_fn: Callable[[Any], Any],
        loss_fn: Callable[[Any, Any], torch.Tensor],
        options: PipelineOptions | None = None,
        ledger: BatchLedger | None = None,
        *,
        handlers: Mapping[S.Kind, Callable[[S.Action], None]] | None = None,
        gradient_buckets: Any = None,
        progress: Any = None,
        parts: Parts = (),
        chunk_sizes: Sequence[int] | None = None,
    ) -> None:
        self.layers = list(layers)
        # each chunk's layers (``chunk_sizes``: interleaved 1F1B's, in order; default one chunk, all of them)
        bounds = [0, *itertools.accumulate(chunk_sizes or [len(self.layers)])]
        self.chunk_ranges = list(zip(bounds, bounds[1:]))
        self.num_virtual = layout.num_stages * len(self.chunk_ranges)
        self.ledger = ledger if ledger is not None else BatchLedger()  # per-batch state (the engine's)
        options = options or PipelineOptions(boundary_dtype=None)
        dtype = options.boundary_dtype
        assert dtype != "auto", (
            "the caller resolves boundary_dtype='auto' (the engine: None; the strategy: its precision)"
        )
        self.boundary_dtype = dtype  # floating-point boundary tensors travel in it (None: their own)
        self.stage = stage
        self.layout = layout  # the run's (its depth and microbatches)
        self.link = link
        self.versions = versions
        self.input_fn = input_fn
        self.loss_fn = loss_fn
        self.recomputed = recomputed_layers(options.recompute, stage, len(self.layers))  # its first layers
        self.keys = options.keys  # how messages name the options
        self.is_first = stage == 0
        self.is_last = stage == layout.num_stages - 1
        self._microbatches: dict[int, Any] = {}
        self._keys: dict[int, tuple] = {}  # microbatch -> ("train", input signature): the link's shape cache key
        # by (chunk, microbatch):
        self._received: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._stash: dict[tuple[int, int], tuple[tuple[torch.Tensor, ...], Any]] = {}
        self._to_send: dict[tuple[int, int], Any] = {}
        self._grads_in: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.max_stashed = 0
        self.stash_bytes = 0  # boundary tensors kept for the backward: each stashed microbatch's inputs and outputs
        self.peak_stash_bytes = 0
        self.recorder: ActionRecorder | None = None  # set one to record every action (observe/timeline.py)
        self.meter: SavedTensorMeter | None = None  # set one to count stashed activation bytes
        self.progress = progress  # an observer.Progress, to publish every action (hang detection)
        self.gradient_buckets = gradient_buckets  # a grad_buckets.GradientBuckets: armed at a batch's last backward
        self.parts = parts  # the update's parts and their collectives, as the lowering reads them
        self._takes: set[tuple[int, int]] = set()  # (layer, argument count) checked by _check_takes
        self._fused: S.Action | None = None
        # a split backward (ZB-H1): B computes the input gradients, W the deferred weight gradients
        self.weight_grads = WeightGradients() if layout.mode.splits_backward else None
        self.handlers: dict[S.Kind, Callable[[S.Action], None]] = {  # {Kind: handler}: the interpreter's table
            S.RECV_FORWARD: self._recv_forward,
            S.FORWARD: self._forward,
            S.SEND_FORWARD: self._send_forward,
            S.RECV_BACKWARD: self._recv_backward,
            S.BACKWARD: self._backward,
            S.SEND_BACKWARD: self._send_backward,
            S.WEIGHT: self._weight,
            S.WAIT_SENDS: lambda action: self.link.wait_sends(),
            S.TICK: lambda action: self.link.exchange(),  # the ring's lockstep (interleaved 1F1B: ``lockstep.py``)
            **(handlers or {}),  # the update's parts and the loss
        }
        if len(self.chunk_ranges) > 1:  # interleaved 1F1B's ring: its messages in lockstep (``lockstep.py``)
            self.handlers.update(lockstep_handlers(self))

    # ----------------------------------------------------------------- data in
    def feed(self, batch: int, microbatches: Sequence[Any]) -> None:
        """Register batch ``batch``'s microbatches (needed on the first and the last stage)."""
        if len(microbatches) != self.num_microbatches:
            raise ValueError(f"expected {self.num_microbatches} microbatches, got {len(microbatches)}")
        for j, microbatch in enumerate(microbatches):
            k = batch * self.num_microbatches + j
            if self.is_first or self.is_last:
                self._microbatches[k] = microbatch
            if self.num_stages > 1:
                self._keys[k] = ("train", input_signature(microbatch))

    @property
    def num_stages(self) -> int:
        return self.layout.num_stages

    @property
    def num_microbatches(self) -> int:
        return self.layout.num_microbatches

    @property
    def stashed_microbatches(self) -> int:
        """Microbatches forwarded here whose backward has not run yet."""
        return len(self._stash)

    @property
    def in_flight(self) -> bool:
        deferred = self.weight_grads is not None and self.weight_grads.in_flight
        return bool(self._stash or self._received or self._to_send or self._grads_in or self._keys or deferred)

    # ----------------------------------------------------------------- compute
    def run_layers(self, inputs: tuple[torch.Tensor, ...], start: int = 0, stop: int | None = None) -> Any:
        """The stage's layers ``start`` to ``stop`` in order: a tuple a layer returns is the next layer's positional
        arguments."""
        value: Any = inputs if len(inputs) > 1 else inputs[0]
        stop = len(self.layers) if stop is None else stop
        for index in range(start, stop):
            layer = self.layers[index]
            if isinstance(value, tuple):
                self._check_takes(index, len(value))
                value = layer(*value)
            else:
                value = layer(value)
        return value

    def _check_takes(self, index: int, count: int) -> None:
        """A clear error, before the call, when layer ``index`` cannot take ``count`` positional arguments."""
        if (index, count) in self._takes:
            return
        layer = self.layers[index]
        try:
            signature = inspect.signature(layer.forward)
        except (TypeError, ValueError):  # no signature to read (a builtin): let the call speak
            self._takes.add((index, count))
            return
        try:
            signature.bind(*range(count))
        except TypeError:
            raise TypeError(
                f"pd2bw: layer {index} of stage {self.stage} ({type(layer).__name__}.forward{signature}) receives the "
                f"previous layer's tuple of {count} values as positional arguments (layer(*outputs)), and its "
                f"forward cannot take {count}. Give forward one parameter per element of the tuple, in order "
                "(e.g. forward(self, hidden, mask)), or return fewer values from the layer before it"
            ) from None
        self._takes.add((index, count))

    def _boundary(self, outputs: Any) -> tuple[torch.Tensor, ...]:
        """What crosses to the next stage: a tensor or a tuple of tensors, else an error naming the layer."""
        sent = as_tuple(outputs)
        if isinstance(sent, tuple) and sent and all(isinstance(t, torch.Tensor) for t in sent):
            return sent
        kinds = (
            type(outputs).__name__
            if not isinstance(outputs, tuple)
            else f"({', '.join(type(v).__name__ for v in outputs)})"
        )
        raise TypeError(
            f"pd2bw: the last layer of stage {self.stage} ({type(self.layers[-1]).__name__}) returned {kinds}, which "
            "cannot cross to the next stage. A layer at a stage boundary returns a tensor or a tuple of tensors "
            "(floating-point ones carry gradients; integer or bool ones, e.g. an attention mask, travel without): "
            "return a tuple instead of a dict or a dataclass, and leave out None entries"
        )

    def _wire(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """The tensors as they cross the boundary: floating-point ones in ``boundary_dtype``."""
        dtype = self.boundary_dtype
        if dtype is None:
            return tensors
        return tuple(t.detach().to(dtype) if t.is_floating_point() and t.dtype != dtype else t for t in tensors)

    def virtual_stage(self, chunk: int) -> int:
        """The (virtual) stage ``chunk`` of this stage is: ``chunk x d + stage`` (one chunk: the stage)."""
        return chunk * self.num_stages + self.stage

    def _forward(self, action: S.Action) -> None:
        k, chunk = action.microbatch, action.chunk
        key, virtual = (chunk, k), self.virtual_stage(chunk)
        first, last = virtual == 0, virtual == self.num_virtual - 1
        start, stop = self.chunk_ranges[chunk]
        self.versions.use(action.weight_version)
        if first:
            inputs = as_tuple(self.input_fn(self._microbatches[k]))
        else:
            received = self.link.arrived(self._received.pop(key))  # interleaved: its tick's batch waited for here
            inputs = tuple(t.requires_grad_() if carries_gradient(t) else t for t in received)
        deferring = self.weight_grads.intercept(k) if self.weight_grads is not None else nullcontext()
        with self._saved_tensor_hooks():
            if self.recomputed:  # the first layers keep only their input; the rest their activations
                value = checkpoint(self.run_layers, inputs, 0, self.recomputed, use_reentrant=False)
                with deferring:  # a recomputed layer's linear maps run undivided (its recomputation must match)
                    outputs = self.run_layers(value if isinstance(value, tuple) else (value,), self.recomputed)
            else:
                with deferring:
                    outputs = self.run_layers(inputs, start, stop)
            if last:
                loss = self.loss_fn(outputs, self._microbatches.pop(k))
                # a running sum, not a list: m small tensors that live until the step ends, each allocated after
                # that microbatch's activations, kept the host heap from shrinking (+120 MiB at m=48, 4 MiB messages)
                self.ledger.add_loss(action.batch, loss)
                self._stash[key] = (inputs, loss / self.num_microbatches)
            else:
                self._stash[key] = (inputs, outputs)
                self._to_send[key] = self._wire(self._boundary(outputs))
        if first:
            self._microbatches.pop(k, None)
        self.max_stashed = max(self.max_stashed, len(self._stash))
        self.stash_bytes += stash_nbytes(self._stash[key])
        self.peak_stash_bytes = max(self.peak_stash_bytes, self.stash_bytes)

    def _saved_tensor_hooks(self) -> Any:
        meter = self.meter
        if meter is None:
            double = self.versions.double_buffer
            return torch.autograd.graph.saved_tensors_hooks(pack_alias, unpack_alias) if double else nullcontext()
        meter.exclude(self.versions.parameters)  # the weights, whichever version they point at now
        if self.versions.double_buffer:
            return torch.autograd.graph.saved_tensors_hooks(lambda t: meter.pack(pack_alias(t)), meter.unpack)
        return meter.hooks()

    def _backward(self, action: Op) -> None:
        k, chunk = action.microbatch, action.chunk
        key, virtual, chunked = (chunk, k), self.virtual_stage(chunk), len(self.chunk_ranges) > 1
        self.versions.use(action.weight_version)
        inputs, outputs = self._stash.pop(key)
        self.stash_bytes -= stash_nbytes((inputs, outputs))
        if action.last and self.gradient_buckets is not None and not chunked:  # reduce buckets as they fill
            self.gradient_buckets.arm()
        if (
            chunked
            and self.gradient_buckets is not None
            and k % self.num_microbatches == 0
            and chunk == len(self.chunk_ranges) - 1
        ):
            # interleaved: a chunk's gradients are complete at its own last backward, another's later: count from
            # the batch's first backward (its last chunk's), start every bucket after its last (``release`` below)
            self.gradient_buckets.arm(hold=True)
        split = self.weight_grads is not None
        if split and self.gradient_buckets is not None and (k + 1) % self.num_microbatches == 0:
            self.gradient_buckets.arm(hold=True)  # the gradients are complete at the batch's last W: start there
        if virtual == self.num_virtual - 1:
            outputs.backward()
        else:
            # gradients come back for the floating-point outputs only, in their order (an integer mask may sit anywhere)
            carried = [o for o in as_tuple(outputs) if carries_gradient(o)]
            grads = self.link.arrived(self._grads_in.pop(key))
            pairs = [(o, g) for o, g in zip(carried, grads, strict=True) if o.requires_grad]
            torch.autograd.backward([o for o, _ in pairs], [g.to(o.dtype) for o, g in pairs])
        if virtual > 0:
            self._to_send[key] = [
                t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs if carries_gradient(t)
            ]
        if split:
            self.weight_grads.after_backward(k)
        if chunked and action.last and self.gradient_buckets is not None:
            self.gradient_buckets.release()

    def _weight(self, action: Op) -> None:
        """W: the microbatch's deferred weight gradients (``weight_grads.py``); the batch's last starts the buckets'
        reduces held since its last B."""
        self.versions.use(action.weight_version)
        self.weight_grads.compute(action.microbatch)
        if action.last and self.gradient_buckets is not None:
            self.gradient_buckets.release()

    # ----------------------------------------------------------------- driver
    def run(self, actions: Sequence[S.Action]) -> None:
        """Execute ``actions`` in order, lowered (``lowering.lower``), each op through its kind's handler
        (``self.handlers``: the stage's own compute and transport, plus the update's parts and the loss it was built
        with); a failure is marked in the listing of the actions."""
        recorder, progress, handlers = self.recorder, self.progress, self.handlers
        for op in lower(actions, self.parts, self.num_microbatches):
            action = op.action
            if progress is not None:
                progress.tick(action)
            start = recorder.now() if recorder is not None else 0.0
            try:
                self._fused = op.fused
                handler = handlers.get(action.kind)
                if handler is None:
                    raise ValueError(f"no handler for {action}: the update registers its parts (engine.start)")
                handler(op)
            except Exception as error:
                note = f"pd2bw: stage {self.stage} of {self.num_stages} failed at action #{op.index} {action} of:\n"
                add_note(error, note + S.listing(actions, marked=op.index))
                if self.versions.mixed and "dtype" in str(error) and action.kind in (S.FORWARD, S.BACKWARD):
                    add_note(
                        error,
                        _MIXED_WEIGHTS_HINT.format(
                            dtype=self.versions.compute_dtype, option=self.keys.named("weight_dtype", None)
                        ),
                    )
                raise
            if recorder is not None:
                recorder.action(action, start)

    def _gradient_like(self, key: tuple[int, int]) -> list[torch.Tensor]:
        """The sent outputs of (chunk, microbatch) ``key`` that get a gradient back (the shapes of its RECV_B)."""
        return [o for o in as_tuple(self._stash[key][1]) if carries_gradient(o)]

    def _link_key(self, k: int, boundary: int, final: bool) -> tuple:
        """The link's shape key of microbatch ``k`` at the boundary after virtual stage ``boundary`` (one chunk:
        the microbatch's own, dropped at its ``final`` use; chunks: one per boundary, dropped at the drain)."""
        if len(self.chunk_ranges) == 1:
            return self._keys.pop(k) if final else self._keys[k]
        return (*self._keys[k], boundary)

    # the transport's handlers (several chunks: ``interleaving.lockstep_handlers``'); ``self._fused``: the receive a
    # send's batch also posts (``schedule.fuse_receives``)
    def _recv_forward(self, action: S.Action) -> None:
        k, chunk = action.microbatch, action.chunk
        key = self._link_key(k, self.virtual_stage(chunk) - 1, self.is_last)
        self._received[(chunk, k)] = self.link.recv_forward(key)

    def _send_forward(self, action: S.Action) -> None:
        k, chunk, fused = action.microbatch, action.chunk, self._fused
        like = self._gradient_like((fused.chunk, fused.microbatch)) if fused is not None else None
        key = self._link_key(k, self.virtual_stage(chunk), True)
        self.link.send_forward(self._to_send.pop((chunk, k)), key, like, self.boundary_dtype)

    def _recv_backward(self, action: S.Action) -> None:
        key = (action.chunk, action.microbatch)
        self._grads_in[key] = self.link.recv_backward(self._gradient_like(key), self.boundary_dtype)

    def _send_backward(self, action: S.Action) -> None:
        fused = self._fused
        then = self._keys[fused.microbatch] if fused else None
        self.link.send_backward(self._to_send.pop((action.chunk, action.microbatch)), then)

    def finish_drain(self) -> None:
        """After a drain's actions (they end in WAIT_SENDS): nothing may be in flight; the version rule restarts."""
        self.link.wait_sends()  # nothing left after WAIT_SENDS; a drain with no actions (nothing ran) has none
        if len(self.chunk_ranges) > 1:
            self._keys.clear()  # chunks: a microbatch's shape keys serve every boundary until the batch drains
        if self.in_flight or self.link.posted_receives:
            raise RuntimeError(f"stage {self.stage}: microbatches still in flight after a drain")
        self._microbatches.clear()
        self.versions.reset_after_drain()

    # ----------------------------------------------------------------- evaluation
    def evaluate(
        self,
        microbatches: Sequence[Any],
        metrics_fn: Callable[[Any, Any], dict[str, torch.Tensor]],
        publish: Callable[[list[dict]], Any],
    ) -> Any:
        """Forward-only pass of ``microbatches`` on the newest weights, its results ``publish``ed (``evaluation.py``)."""
        from .evaluation import evaluate

        return evaluate(self, microbatches, metrics_fn, publish)
