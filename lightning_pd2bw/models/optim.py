"""Optimizers and the learning-rate schedule of our models, as plain functions (no Lightning).

The LightningModules' ``configure_optimizers`` calls them with the module's hyper-parameters (``model.optimizer``,
``model.lr``, ... in the Hydra config); a plain PyTorch loop over ``PipelineEngine`` calls them on a core's stage
parameters (``engine.parameters()``) the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .core import warmup_cosine

OPTIMIZERS = ("adamw", "nadamw", "sgd", "muon")


def implementation(params: list[nn.Parameter]) -> dict[str, bool]:
    """The fastest implementation torch has for the parameters' device: ``fused=True`` (one kernel for every tensor's
    update) on CUDA, ``foreach=True`` (one op per step over all tensors) elsewhere. Both compute the per-tensor
    rule's update, to floating-point rounding; the step post-hooks (sparsity masks) and the delay correction read
    the weights after the step, whichever implementation ran it."""
    devices = {p.device.type for p in params}
    if devices == {"cuda"}:
        return {"fused": True}
    return {"foreach": True} if devices <= {"cpu", "cuda"} else {}


def adamw(params: list[nn.Parameter], lr: float, weight_decay: float, betas: tuple[float, float]) -> torch.optim.AdamW:
    """AdamW without weight decay on biases and norms (1-D tensors); fused on CUDA, foreach on the CPU."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), **implementation(params))


def nadamw(params: list[nn.Parameter], lr: float, weight_decay: float, betas: tuple[float, float]) -> torch.optim.NAdam:
    """NAdamW (Nesterov momentum, Dozat 2016; decoupled weight decay), grouped as ``adamw`` groups its parameters;
    foreach on every device (torch has no fused NAdam)."""
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    foreach = {"foreach": True} if implementation(params) else {}
    return torch.optim.NAdam(groups, lr=lr, betas=tuple(betas), decoupled_weight_decay=True, **foreach)


def build_optimizers(
    params: list[nn.Parameter],
    matrices: list[nn.Parameter],
    optimizer: str = "adamw",
    lr: float = 3e-4,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    momentum: float = 0.0,
) -> list[torch.optim.Optimizer]:
    """``adamw`` | ``nadamw`` | ``sgd`` | ``muon``: Muon for ``matrices`` (the blocks' weight matrices) and AdamW for the rest
    of ``params`` (embeddings, the head, norms, biases), as Muon's recipe pairs them.

    Under ``strategy="pd2bw"`` the parameters of other stages are placeholders on the meta device: each optimizer
    leaves them out when it has real ones (the engine would drop them), so that the fused CUDA kernels, which
    refuse meta tensors, can be used; an optimizer with no parameter on this stage keeps its placeholders.

    Args:
        params: every parameter to optimize.
        matrices: those of ``params`` Muon takes (the blocks' weight matrices); unused by ``adamw`` and ``sgd``.
        optimizer: ``"adamw"``, ``"nadamw"`` (AdamW with Nesterov momentum), ``"sgd"`` or ``"muon"``.
        lr: the learning rate (Muon's scaled to match AdamW's update size).
        weight_decay: decoupled weight decay (AdamW, Muon) or L2 (SGD).
        betas: AdamW's.
        momentum: SGD's.
    """
    params = _real_or_all(params)
    if optimizer == "sgd":
        return [torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, **implementation(params))]
    if optimizer == "adamw":
        return [adamw(params, lr, weight_decay, betas)]
    if optimizer == "nadamw":
        return [nadamw(params, lr, weight_decay, betas)]
    if optimizer == "muon":
        matrices = _real_or_all(matrices)
        chosen = {id(p) for p in matrices}
        rest = [p for p in params if id(p) not in chosen]
        muon = Muon(matrices, lr=lr, weight_decay=weight_decay, momentum=0.95, adjust_lr_fn="match_rms_adamw")
        return [muon, adamw(rest, lr, weight_decay, betas)]
    raise ValueError(f"optimizer={optimizer!r} is not supported; valid: {', '.join(OPTIMIZERS)}")


def scale_learning_rates(optimizers: list[torch.optim.Optimizer], scales: dict[int, float]) -> None:
    """Give the parameters in ``scales`` (``id(param)`` -> factor) their own groups in Adam-type optimizers, at the
    group's rate times the factor (``group["lr_scale"]`` records it), before any step and before a schedule reads the
    rates: SμPar's per-layer rate (``SparsityCallback(density_scaling=True)``). SGD and Muon keep theirs (SμPar's
    rate rule is Adam's). Under AdamW the group's weight decay is divided by the factor: torch decays by rate x
    ``weight_decay`` per step, and μP's rules (SμPar's among them) take weight decay independent of the rate they
    scale, so a scaled layer decays as the dense one does (until 0.17.0 it decayed 1/density times faster)."""
    for optimizer in optimizers:
        if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
            continue
        groups = []
        for group in optimizer.param_groups:
            by_scale: dict[float, list[nn.Parameter]] = {}
            for param in group["params"]:
                by_scale.setdefault(scales.get(id(param), 1.0), []).append(param)
            for scale, params in sorted(by_scale.items()):
                decay = group.get("weight_decay", 0.0) / (scale if isinstance(optimizer, torch.optim.AdamW) else 1.0)
                groups.append(
                    {**group, "params": params, "lr": group["lr"] * scale, "lr_scale": scale, "weight_decay": decay}
                )
        optimizer.param_groups[:] = groups


def newton_schulz(
    grad: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """Muon's quintic Newton-Schulz orthogonalisation of a matrix, as ``torch.optim.Muon`` computes it, in ``dtype``
    (torch: always bfloat16)."""
    a, b, c = coefficients
    wide = grad.size(0) > grad.size(1)
    x = grad.to(dtype)
    x = x.T if wide else x
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if wide else x


class Muon(torch.optim.Muon):
    """``torch.optim.Muon``, with its Newton-Schulz iteration in ``ns_dtype``: default bfloat16 (torch's choice) on
    accelerators and float32 on the CPU, where bfloat16 matmuls have no fast kernels (30-37x slower than float32 on
    this project's CPU machine, one thread: docs/muon-log.md). ``ns_dtype=torch.bfloat16`` steps exactly
    as torch's Muon does (tests/unit/test_optim.py); the state (``momentum_buffer``) and the options are torch's."""

    def __init__(self, params: Any, *args: Any, ns_dtype: torch.dtype | None = None, **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                if grad.ndim != 2 or torch.is_complex(param) or grad.is_sparse:
                    raise RuntimeError("Muon steps real, dense 2-D parameters only")
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
                buffer = state["momentum_buffer"]
                buffer.lerp_(grad, 1 - momentum)
                update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
                dtype = self.ns_dtype or (torch.float32 if param.device.type == "cpu" else torch.bfloat16)
                update = newton_schulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"], dtype)
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update, alpha=-lr * _lr_ratio(group["adjust_lr_fn"], param.shape))
        return loss


def _lr_ratio(adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """Muon's learning-rate adjustment for a matrix of ``shape`` (torch's ``adjust_lr_fn`` options)."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols)) if adjust_lr_fn == "match_rms_adamw" else 1.0


def _real_or_all(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """The parameters that are not meta placeholders, or all of them when every one is."""
    return [p for p in params if not p.is_meta] or list(params)


def block_matrices(blocks: list[nn.Module]) -> list[nn.Parameter]:
    """The trainable 2-D weights of the transformer blocks (Muon's parameters), each once."""
    return list(dict.fromkeys(p for b in blocks for p in b.parameters() if p.requires_grad and p.dim() == 2))


def warmup_cosine_schedule(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int,
    max_steps: int | Callable[[], int] | None,
    min_lr_ratio: float,
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then cosine decay to ``min_lr_ratio`` at ``max_steps`` (stepped once per optimizer step;
    a callable is read once, after the warm-up)."""
    if callable(max_steps):
        read, known = max_steps, []

        def max_steps() -> int:  # read once
            if not known:
                known.append(int(read()))
            return known[0]

    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, warmup_steps, max_steps, min_lr_ratio)
    )
