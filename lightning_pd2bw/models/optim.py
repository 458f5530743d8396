"""Optimizers and the learning-rate schedule of our models, as plain functions (no Lightning).

The LightningModules' ``configure_optimizers`` calls them with the module's hyper-parameters (``model.optimizer``,
``model.lr``, ... in the Hydra config); a plain PyTorch loop over ``PipelineEngine`` calls them on a core's stage
parameters (``engine.parameters()``) the same way.
"""

from __future__ import annotations

import torch
from torch import nn

from .core import warmup_cosine

OPTIMIZERS = ("adamw", "sgd", "muon")


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


def build_optimizers(
    params: list[nn.Parameter],
    matrices: list[nn.Parameter],
    optimizer: str = "adamw",
    lr: float = 3e-4,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    momentum: float = 0.0,
) -> list[torch.optim.Optimizer]:
    """``adamw`` | ``sgd`` | ``muon``: Muon for ``matrices`` (the blocks' weight matrices) and AdamW for the rest
    of ``params`` (embeddings, the head, norms, biases), as Muon's recipe pairs them.

    Under ``strategy="pd2bw"`` the parameters of other stages are placeholders on the meta device: each optimizer
    leaves them out when it has real ones (the engine would drop them), so that the fused CUDA kernels, which
    refuse meta tensors, can be used; an optimizer with no parameter on this stage keeps its placeholders."""
    params = _real_or_all(params)
    if optimizer == "sgd":
        return [torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, **implementation(params))]
    if optimizer == "adamw":
        return [adamw(params, lr, weight_decay, betas)]
    if optimizer == "muon":
        matrices = _real_or_all(matrices)
        chosen = {id(p) for p in matrices}
        rest = [p for p in params if id(p) not in chosen]
        muon = torch.optim.Muon(
            matrices, lr=lr, weight_decay=weight_decay, momentum=0.95, adjust_lr_fn="match_rms_adamw"
        )
        return [muon, adamw(rest, lr, weight_decay, betas)]
    raise ValueError(f"optimizer={optimizer!r} is not supported; valid: {', '.join(OPTIMIZERS)}")


def _real_or_all(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """The parameters that are not meta placeholders, or all of them when every one is."""
    return [p for p in params if not p.is_meta] or list(params)


def block_matrices(blocks: list[nn.Module]) -> list[nn.Parameter]:
    """The trainable 2-D weights of the transformer blocks (Muon's parameters), each once."""
    return list(dict.fromkeys(p for b in blocks for p in b.parameters() if p.requires_grad and p.dim() == 2))


def warmup_cosine_schedule(
    optimizer: torch.optim.Optimizer, warmup_steps: int, max_steps: int | None, min_lr_ratio: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then cosine decay to ``min_lr_ratio`` at ``max_steps`` (stepped once per optimizer step)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, warmup_steps, max_steps, min_lr_ratio)
    )
