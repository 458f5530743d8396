"""Lightning callbacks for scheduled unstructured sparsity, one per schedule (gradual magnitude pruning, static masks,
RigL) over ``callback_base.SparsityCallback``, which says where masks are applied under a single device, DDP and
``strategy="pd2bw"``."""

from __future__ import annotations

from typing import Any

from ..engine.precision import Precision
from . import schedules
from .callback_base import (  # noqa: F401  (flops_ratio: re-exported)
    INITS,
    SparsityCallback,
    _check_choice,
    _check_init_allocation,
    _check_range,
    flops_ratio,
)
from .masks import MaskUpdate
from .semi_sparse import check as check_kernels
from .semi_sparse import layers_of, use_kernels
from .transposable import MAX_TILE


class GradualMagnitudeSparsity(SparsityCallback):
    """Gradual magnitude pruning: sparsity from ``initial_sparsity`` to ``sparsity`` between
    ``start_step`` and ``end_step``, updated every ``update_interval`` steps (cubic or linear).

    Args:
        sparsity: the final fraction of zeros in the targeted weights, in [0, 1).
        end_step: the step the final sparsity is reached.
        start_step: the step pruning begins.
        update_interval: steps between mask updates.
        initial_sparsity: the sparsity at ``start_step``.
        shape: ``"cubic"`` (Zhu and Gupta's) or ``"linear"``.
        **kwargs: ``SparsityCallback``'s: ``allocation``, ``targets``, ``exclude``, ``min_layer_density``,
            ``dense_from_step``, ``rewarmup_steps``, ``dense_lr``, ``seed``, ``log_per_layer``.
    """

    def __init__(
        self,
        sparsity: float,
        end_step: int,
        start_step: int = 0,
        update_interval: int = 100,
        initial_sparsity: float = 0.0,
        shape: str = "cubic",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        _check_range("sparsity", sparsity, 0.0, 1.0, closed_high=False)
        _check_range("initial_sparsity", initial_sparsity, 0.0, sparsity)
        _check_choice("shape", shape, schedules.SHAPES)
        if not 0 <= start_step < end_step:
            raise ValueError(
                f"GradualMagnitudeSparsity(start_step={start_step}, end_step={end_step}): need 0 <= start_step < end_step"
            )
        if update_interval < 1:
            raise ValueError(f"GradualMagnitudeSparsity(update_interval={update_interval}) must be >= 1")
        self.sparsity, self.initial_sparsity = sparsity, initial_sparsity
        self.start_step, self.end_step, self.update_interval, self.shape = start_step, end_step, update_interval, shape

    def density_at(self, step: int) -> float:
        return schedules.gradual_density(
            step,
            self.start_step,
            self.end_step,
            self.update_interval,
            1 - self.sparsity,
            1 - self.initial_sparsity,
            self.shape,
        )

    def plan(self, step: int) -> MaskUpdate | None:
        if schedules.is_update_step(step, self.start_step, self.end_step, self.update_interval):
            return MaskUpdate("magnitude", density=self.density_at(step))
        return None


class StaticSparsity(SparsityCallback):
    """A mask fixed before the first step (random, as SambaNova/Cerebras, or by magnitude at init).

    Args:
        sparsity: the fraction of zeros in the targeted weights, in [0, 1).
        init: ``"random"`` or ``"magnitude"`` (of the initial weights).
        **kwargs: ``SparsityCallback``'s: ``allocation``, ``targets``, ``exclude``, ``min_layer_density``,
            ``dense_from_step``, ``rewarmup_steps``, ``dense_lr``, ``density_scaling``, ``seed``, ``log_per_layer``.
    """

    constant_density = True

    def __init__(self, sparsity: float, init: str = "random", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        _check_range("sparsity", sparsity, 0.0, 1.0, closed_high=False)
        _check_choice("init", init, INITS)
        _check_init_allocation(init, self.allocation)
        self.sparsity, self.init = sparsity, init

    def plan(self, step: int) -> MaskUpdate | None:
        return MaskUpdate(self.init, density=1 - self.sparsity) if step == 0 else None


class RigL(SparsityCallback):
    """RigL: a sparse mask from step 0; every ``update_interval`` steps until ``end_step`` drop the
    smallest active weights and grow as many by gradient magnitude (cosine-decayed fraction). Needs every
    gradient on every replica: refused with ``shard_gradients=True``.

    Args:
        sparsity: the fraction of zeros in the targeted weights, in [0, 1), from step 0.
        end_step: the last step the connections change.
        update_interval: steps between drop-and-grow updates.
        drop_fraction: the fraction of active weights replaced at the first update (decayed by a cosine).
        init: ``"random"`` or ``"magnitude"``: the mask at step 0.
        allocation: ``"erk"`` by default (RigL's), else as ``SparsityCallback``.
        **kwargs: ``SparsityCallback``'s: ``targets``, ``exclude``, ``min_layer_density``,
            ``dense_from_step``, ``rewarmup_steps``, ``dense_lr``, ``density_scaling``, ``seed``, ``log_per_layer``.
    """

    reads_gradients = "grows connections by gradient"  # the regrowth ranks |gradient| (why, for messages)
    constant_density = True

    def __init__(
        self,
        sparsity: float,
        end_step: int,
        update_interval: int = 100,
        drop_fraction: float = 0.3,
        init: str = "random",
        allocation: str = "erk",
        **kwargs: Any,
    ) -> None:
        super().__init__(allocation=allocation, **kwargs)
        _check_range("sparsity", sparsity, 0.0, 1.0, closed_high=False)
        _check_range("drop_fraction", drop_fraction, 0.0, 1.0, closed_high=False)
        _check_choice("init", init, INITS)
        _check_init_allocation(init, allocation)
        if end_step < 1 or update_interval < 1:
            raise ValueError(f"RigL(end_step={end_step}, update_interval={update_interval}) must both be >= 1")
        self.sparsity, self.end_step, self.update_interval = sparsity, end_step, update_interval
        self.drop_fraction, self.init = drop_fraction, init

    def plan(self, step: int) -> MaskUpdate | None:
        if step == 0:
            return MaskUpdate(self.init, density=1 - self.sparsity)
        if step % self.update_interval == 0 and step < self.end_step:
            return MaskUpdate(
                "rigl", drop_fraction=schedules.rigl_drop_fraction(step, self.end_step, self.drop_fraction)
            )
        return None


class SemiStructuredSparsity(SparsityCallback):
    """N:M semi-structured sparsity (2:4 by default, the pattern GPUs' sparse tensor cores run): in every targeted
    weight at most ``n`` non-zeros in each group of ``m`` consecutive weights along its last dimension (a Linear's
    input features, the GEMM's reduction dimension), chosen by magnitude. Gradual: dense until ``start_step``, then
    the kept count per group falls from ``m`` to ``n`` over the window (``schedules.n_of_m_at``), the masks recomputed
    from the weights every ``update_interval`` steps; fixed from ``end_step`` on (``start_step == end_step``: one
    shot). ``dense_from_step`` gives SPDF's dense finish. The masks cut FLOPs on paper; a GPU runs them faster only
    through the semi-structured kernels: ``kernels=True`` (``semi_sparse.py``; their speed: docs/sparsity.md).

    Args:
        n: weights kept per group (0 < n < m).
        m: the group's size.
        start_step: the first step of the window over which the groups thin from m to n.
        end_step: the window's last step; the mask is fixed from it on.
        update_interval: steps between mask updates in the window.
        sparsity: optional, must equal ``1 - n / m`` (a recipe's ``sparsity.sparsity`` checked, not used).
        transposable: N:M along the rows and the columns of each ``m`` x ``m`` tile (``m <= 4``), the largest total
            magnitude per tile: the weight and its transpose both N:M, so the input-gradient GEMM can be sparse too
            (None: as ``kernels``).
        kernels: on CUDA (compute capability >= 8.0, float16 / bfloat16), once the mask is final the targeted
            ``nn.Linear`` layers run their forward and input-gradient GEMMs on the 2:4 sparse tensor cores (needs
            ``n=2, m=4`` and a transposable mask); refused by name at the start where they cannot run.
        **kwargs: ``SparsityCallback``'s: ``targets``, ``exclude``, ``dense_from_step``, ``rewarmup_steps``,
            ``dense_lr``, ``seed``, ``log_per_layer`` (the allocation is per group: ``uniform`` only).
    """

    def __init__(
        self,
        n: int = 2,
        m: int = 4,
        start_step: int = 0,
        end_step: int = 0,
        update_interval: int = 100,
        sparsity: float | None = None,
        transposable: bool | None = None,
        kernels: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        transposable = kernels if transposable is None else transposable
        if kernels and (n, m, transposable) != (2, 4, True):
            raise ValueError(
                f"SemiStructuredSparsity(kernels=True, n={n}, m={m}, transposable={transposable}): the 2:4 kernels run "
                "the forward and the input-gradient GEMMs from one mask: set n=2, m=4, transposable=True"
            )
        if not 0 < n < m:
            raise ValueError(f"SemiStructuredSparsity(n={n}, m={m}): need 0 < n < m (2:4 is n=2, m=4)")
        if transposable and m > MAX_TILE:
            raise ValueError(
                f"SemiStructuredSparsity(m={m}, transposable=True): transposable masks are chosen per m x m tile among "
                f"every qualifying pattern, m <= {MAX_TILE}; set m=4 or transposable=False"
            )
        if sparsity is not None and abs(sparsity - (1 - n / m)) > 1e-9:
            raise ValueError(
                f"sparsity.sparsity={sparsity} contradicts n={n}, m={m} (sparsity {1 - n / m:g}): N:M sets its own; "
                f"set sparsity.sparsity={1 - n / m:g} or null"
            )
        if not 0 <= start_step <= end_step:
            raise ValueError(
                f"SemiStructuredSparsity(start_step={start_step}, end_step={end_step}): need 0 <= start_step <= end_step"
            )
        if update_interval < 1:
            raise ValueError(f"SemiStructuredSparsity(update_interval={update_interval}) must be >= 1")
        if self.allocation != "uniform":
            raise ValueError(
                f"sparsity allocation={self.allocation!r} does not apply to N:M sparsity (every group keeps n of m): "
                "leave allocation=uniform"
            )
        self.n, self.m, self.sparsity = n, m, 1 - n / m
        self.start_step, self.end_step, self.update_interval = start_step, end_step, update_interval
        self.transposable, self.kernels = transposable, kernels
        self._kernel_layers: dict[str, Any] = {}

    def build(self, module: Any, all_reduce: Any = None, device: Any = None) -> Any:
        sparsifier = super().build(module, all_reduce, device)
        sparsifier.check_groups(self.m, self.transposable)  # refused by name at the start, not at the first update
        return sparsifier

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_start(trainer, pl_module)
        if self.kernels:
            self.attach_kernels(pl_module, trainer.strategy.root_device, Precision.of(trainer.precision).compute_dtype)

    def attach_kernels(self, module: Any, device: Any, dtype: Any) -> None:
        """The layers of the built sparsifier's targets (of ``module``) take the 2:4 kernels when the schedule allows
        (``after_step`` switches them); refused by name where they cannot run on ``device`` in ``dtype``. The
        Lightning hooks call it; an engine-level loop (``build``, ``before_step``, ``after_step``) calls it once."""
        self._kernel_layers = layers_of(module, list(self.sparsifier.local))
        check_kernels(self._kernel_layers, device, dtype)
        self._sync_kernels()

    def after_step(self, optimizers: Any) -> None:
        super().after_step(optimizers)
        self._sync_kernels()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        super().on_train_end(trainer, pl_module)
        for layer in self._kernel_layers.values():  # the module leaves fit as it came
            use_kernels(layer, False)

    def _sync_kernels(self) -> None:
        """The kernels run once every weight a forward can read is 2:4 (the compression would drop the rest): from
        the start for a one-shot mask at step 0, else two updates after the final mask's (2BW's forward reads the
        version before the last update), until SPDF's dense finish."""
        final = self.end_step == 0 or self.step >= self.end_step + 2
        on = final and (self.dense_from_step is None or self.step < self.dense_from_step)
        for layer in self._kernel_layers.values():
            use_kernels(layer, on)

    def plan(self, step: int) -> MaskUpdate | None:
        if not schedules.is_update_step(step, self.start_step, self.end_step, self.update_interval):
            return None
        kept = schedules.n_of_m_at(step, self.start_step, self.end_step, self.n, self.m)
        return MaskUpdate("n_of_m", density=kept / self.m, n=kept, m=self.m, transposable=self.transposable)
