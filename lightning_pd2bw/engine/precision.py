"""A Lightning precision setting and every dtype and byte count that follows from it, in one place: the engine's
``"auto"`` weight and boundary dtypes, the planner's bytes per parameter and activation, the weight versions' bytes
and the dtype the device's peak FLOPs are quoted for (as Lightning's ``FSDPStrategy.mixed_precision_config`` maps a
precision to its dtypes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

LEGACY = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "64": "64-true"}  # Lightning's short forms
SUPPORTED = ("32-true", "bf16-mixed", "64-true")  # what strategy="pd2bw" runs (lightning/checks.py refuses the rest)


@dataclass(frozen=True)
class Precision:
    """``Precision.of("bf16-mixed")``; ``name`` is Lightning's long form (``"32"`` becomes ``"32-true"``)."""

    name: str = "32-true"

    @classmethod
    def of(cls, precision: object) -> Precision:
        """From what Lightning takes (``"bf16-mixed"``, ``32``, ``"bf16"``) or from ``trainer.precision``; None: 32-true."""
        if isinstance(precision, Precision):
            return precision
        name = "32-true" if precision is None else str(precision)
        return cls(LEGACY.get(name, name))

    @property
    def supported(self) -> bool:
        """Whether the strategy runs this precision (``SUPPORTED``)."""
        return self.name in SUPPORTED

    @property
    def true_16bit(self) -> bool:
        """The parameters themselves in 16 bits (``bf16-true``, ``16-true``): no float32 master."""
        return self.name in ("bf16-true", "16-true")

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The 16-bit dtype computed in under autocast where ``"auto"`` weight and boundary dtypes follow it
        (``bf16-mixed``: bfloat16), else None (the tensors' own dtype)."""
        return torch.bfloat16 if self.name == "bf16-mixed" else None

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the matmuls run in: what the device's peak FLOPs are quoted for (the MFU's denominator)."""
        if self.name.startswith("bf16"):
            return torch.bfloat16
        if self.name.startswith("16"):
            return torch.float16
        return torch.float64 if self.name.startswith("64") else torch.float32

    @property
    def parameter_dtype(self) -> torch.dtype | None:
        """The parameters' own dtype where the precision sets it (``bf16-true``: bfloat16), else None (as built)."""
        return {"bf16-true": torch.bfloat16, "16-true": torch.float16}.get(self.name)

    @property
    def parameter_bytes(self) -> int:
        """Bytes per parameter (and per gradient and optimizer state) the planner counts."""
        return 2 if self.true_16bit else 4

    @property
    def activation_bytes(self) -> int:
        """Bytes per activation element the planner counts: 4 in full precision, 2 under any 16-bit setting."""
        return 4 if self.name in ("32-true", "64-true") else 2

    def version_bytes(self, weight_dtype: str | torch.dtype | None) -> int | None:
        """Bytes per parameter of each weight version held apart from a float32 master (``weight_dtype``: the run's,
        resolved), or None where the versions are the weights themselves."""
        if weight_dtype == "auto":
            raise ValueError("version_bytes takes a resolved weight_dtype (a Run's: PipelineOptions.resolve)")
        if weight_dtype is None or self.true_16bit:
            return None
        dtype = getattr(torch, weight_dtype) if isinstance(weight_dtype, str) else weight_dtype
        return dtype.itemsize if dtype != torch.float32 else None

    def resolve(self, dtype: str | torch.dtype | None) -> str | torch.dtype | None:
        """``weight_dtype`` or ``boundary_dtype`` with ``"auto"`` resolved under this precision."""
        return self.autocast_dtype if dtype == "auto" else dtype
