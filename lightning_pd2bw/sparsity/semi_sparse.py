"""2:4 sparse tensor-core GEMMs for the masked Linear layers of ``SemiStructuredSparsity(kernels=True)`` on CUDA.

Once the schedule's mask is final (2:4, transposable: ``transposable.py``), each targeted ``nn.Linear`` runs its
forward GEMM (``x @ W.t()``) and its input-gradient GEMM (``g @ W``) on the sparse tensor cores through PyTorch's
semi-structured tensors: CUTLASS on compute capability 8.x (A100), cuSPARSELt on 9.0 and later (H100, H200: PyTorch's
CUTLASS sparse GEMM accepts 8.x only), each ``prune_dense_static_sort`` compressing W and W.t() in one kernel. W is
packed at every forward from the weights as they are and packed again in the backward from the same weight version
(the forward's storage, held by the stage anyway), so nothing packed is kept per microbatch in flight, and a 2BW
weight version or an update needs nothing else. The weight gradient stays a dense GEMM (the callback masks it). The masked weights are zero
outside a transposable 2:4 pattern, so the compression keeps exactly their non-zeros: the kernels compute what the
dense masked GEMM computes, up to the GEMMs' rounding.

The layer's forward is replaced on the instance (``use_kernels``; no hook, the parameters and their names
unchanged) and restored when the kernels stop (SPDF's dense finish). Refused by name where they cannot run: a
device without a backend (not CUDA, compute capability below 8.0, or 9.0+ without cuSPARSELt), a compute dtype other
than float16 or bfloat16, a target that is not an ``nn.Linear`` (Hugging Face's ``Conv1D`` holds its weight
transposed), or a weight whose dimensions are not multiples of the backend's tile (``MULTIPLES``, for W and W.t())."""

from __future__ import annotations

import types
from collections.abc import Mapping

import torch
from torch import nn

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
# each backend's tile for 16-bit types, for W and W.t() alike: CUTLASS's sparse operand has rows a multiple of 32 and
# columns of 64; cuSPARSELt's packing of the tile kernel's output takes multiples of 128
MULTIPLES = {"cutlass": 64, "cusparselt": 128}
MIN_CAPABILITY = (8, 0)
CUTLASS_CAPABILITIES = (8,)  # PyTorch's CUTLASS semi-structured GEMM (sparse_semi_structured_mad_op): 8.x only
# How the CUDA tile kernel picks each 4 x 4 tile's 2:4 pattern (aten/src/ATen/native/sparse/cuda/ComputeSparseTile.h,
# LargestValuesGreedy: values taken largest first while their row and column have room). Its default ("") ranks
# them by signed value, so a zero outranks a negative weight and can take its row's place, dropping the weight: the
# kernels would then compute with another matrix than the masked one. Ranked by magnitude, every non-zero of a
# transposable 2:4 weight comes before any zero and is kept.
TILE_ALGORITHM = "largest_abs_values_greedy"


def backend(capability: tuple[int, int], cusparselt: bool) -> str | None:
    """The 2:4 backend a device of ``capability`` runs: CUTLASS on 8.x, cuSPARSELt (where PyTorch has it,
    ``cusparselt``) on 9.0 and later; None below 8.0, or on 9.0+ without cuSPARSELt."""
    if capability[0] in CUTLASS_CAPABILITIES:
        return "cutlass"
    if capability >= (9, 0) and cusparselt:
        return "cusparselt"
    return None


def device_backend(device: torch.device) -> str | None:
    return backend(torch.cuda.get_device_capability(device), torch.backends.cusparselt.is_available())


def refusal(name: str, module: nn.Module, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the 2:4 kernels cannot run layer ``name`` (None: they can)."""
    if type(module) is not nn.Linear:
        return f"{name} belongs to a {type(module).__name__}, not an nn.Linear"
    rows, cols = module.weight.shape
    if rows % MULTIPLES["cutlass"] or cols % MULTIPLES["cutlass"]:  # every backend's tile is a multiple of this
        return f"{name} is {rows} x {cols}: both dimensions must be multiples of {MULTIPLES['cutlass']}"
    if dtype not in KERNEL_DTYPES:
        return f"the compute dtype is {dtype}: the kernels take float16 or bfloat16 (trainer.precision=bf16-mixed)"
    if device.type != "cuda":
        return f"the run's device is {device.type}: the 2:4 kernels run on CUDA GPUs (compute capability >= 8.0)"
    capability = torch.cuda.get_device_capability(device)
    chosen = device_backend(device)
    if chosen is None:
        return (
            f"{torch.cuda.get_device_name(device)} is compute capability {capability}: no 2:4 backend runs there "
            "(CUTLASS: 8.x; cuSPARSELt: 9.0 and later, and this PyTorch "
            f"{'has' if torch.backends.cusparselt.is_available() else 'lacks'} it)"
        )
    multiple = MULTIPLES[chosen]
    if rows % multiple or cols % multiple:
        return f"{name} is {rows} x {cols}: {chosen}'s tile needs both dimensions multiples of {multiple}"
    return None


def check(layers: Mapping[str, nn.Module], device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, naming the first layer and the fix, when the kernels cannot run every targeted layer."""
    refused = {name: reason for name, layer in layers.items() if (reason := refusal(name, layer, device, dtype))}
    if refused:
        name, reason = next(iter(refused.items()))
        raise ValueError(
            f"SemiStructuredSparsity(kernels=True): {reason} ({len(refused)} of {len(layers)} targeted layers "
            f"refused, first {name}). Set sparsity.kernels=false (kernels=False: the same masks and the same "
            "training on dense GEMMs; the kernels only speed them up), or leave the layers out (sparsity.exclude)"
        )


def packed(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` in ``dtype``, compressed to 2:4 by its device's backend (W and W.t(), with their metadata)."""
    from torch.sparse import SparseSemiStructuredTensorCUSPARSELT, SparseSemiStructuredTensorCUTLASS

    kind = {"cutlass": SparseSemiStructuredTensorCUTLASS, "cusparselt": SparseSemiStructuredTensorCUSPARSELT}
    chosen = kind[device_backend(weight.device)]
    return chosen.prune_dense_static_sort(weight.to(dtype).contiguous(), algorithm=TILE_ALGORITHM)


class _SemiSparseLinear(torch.autograd.Function):
    """``x @ W.t() + b`` with W compressed to 2:4 for the forward and the input gradient; dW dense. The backward packs
    W again from the forward's weight storage (the version the forward read, which the stage holds until this
    microbatch's backward): nothing packed waits per microbatch in flight."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cuda")
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
        flat = x.reshape(-1, x.shape[-1]).to(dtype)
        out = flat @ packed(weight.detach(), dtype).t()
        if bias is not None:
            out = out + bias.to(dtype)
        ctx.weight, ctx.has_bias, ctx.dtypes = weight.detach(), bias is not None, (x.dtype, weight.dtype)
        ctx.save_for_backward(flat)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")
    def backward(ctx, grad: torch.Tensor):
        (flat,) = ctx.saved_tensors
        grad2d = grad.reshape(-1, grad.shape[-1]).to(flat.dtype)
        x_dtype, weight_dtype = ctx.dtypes
        grad_x = (grad2d @ packed(ctx.weight, flat.dtype)).reshape(*grad.shape[:-1], flat.shape[-1]).to(x_dtype)
        grad_weight = (grad2d.t() @ flat).to(weight_dtype)
        grad_bias = grad2d.sum(0).to(weight_dtype) if ctx.has_bias else None
        return grad_x, grad_weight, grad_bias


def _sparse_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return _SemiSparseLinear.apply(x, self.weight, self.bias)


def use_kernels(layer: nn.Linear, on: bool) -> None:
    """Route ``layer``'s forward through the 2:4 kernels (``on``) or back to ``nn.Linear``'s own."""
    if on:
        layer.forward = types.MethodType(_sparse_forward, layer)
    else:
        layer.__dict__.pop("forward", None)


def layers_of(module: nn.Module, names: list[str]) -> dict[str, nn.Module]:
    """Each targeted weight's owning module, by the weight's name."""
    return {name: module.get_submodule(name.rpartition(".")[0]) for name in names}
