"""One GPU, bfloat16: a 13B-shaped block's four matrices, forward + backward, dense against the 2:4 kernels
(``SemiStructuredSparsity(kernels=True)``'s path, ``lightning_pd2bw/sparsity/semi_sparse.py``; issue 80, item 5).

    python benchmarks/gpu_semi_sparse.py                      # gpt13b's width 5120, 2,048 tokens (micro 1)
    python benchmarks/gpu_semi_sparse.py --width 2048 --tokens 4096

Per matrix of a GPT block (attention's QKV and output, the MLP's two), an ``nn.Linear`` in bfloat16 with its weight
pruned to a transposable 2:4 mask is timed (CUDA events, median of ``--iters`` after ``--warmup``) in a forward and
backward of ``--tokens`` rows: once dense, once through the kernels, and the forward alone both ways. Prints each
shape's times, their ratios and the block's; checks first that the kernels' output and input gradient agree with
the dense masked GEMM's to bfloat16's rounding (relative error under 2e-2). Needs a CUDA GPU of compute capability
8.0 or more; ``--json PATH`` writes the records; ``--record DEVICE`` (the planner's name, e.g. ``h100_80g``) writes
the forward's ratio per shape into ``lightning_pd2bw/planner/semi_sparse_speedup.json``, the planner's factor for
the forward and the input-gradient GEMMs of a run with ``sparsity.kernels=true`` (1.0 for a shape not measured).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import statistics
import sys
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_pd2bw.planner.semi_sparse_speedup import TABLE, shape_key  # noqa: E402
from lightning_pd2bw.sparsity.semi_sparse import check, use_kernels  # noqa: E402
from lightning_pd2bw.sparsity.transposable import transposable_mask  # noqa: E402


def block_linears(width: int) -> dict[str, nn.Linear]:
    """A GPT block's matrices (out x in), as ``lightning_pd2bw.models`` shapes them."""
    return {
        "attn.qkv": nn.Linear(width, 3 * width),
        "attn.proj": nn.Linear(width, width),
        "mlp.fc": nn.Linear(width, 4 * width),
        "mlp.proj": nn.Linear(4 * width, width),
    }


def timed(layer: nn.Linear, x: torch.Tensor, warmup: int, iters: int, backward: bool = True) -> float:
    """Median milliseconds of one forward + backward (``backward=False``: the forward alone)."""
    grad = torch.randn(x.shape[0], layer.out_features, device=x.device, dtype=x.dtype)
    times = []
    for i in range(warmup + iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = layer(x)
        if backward:
            out.backward(grad)
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
        layer.weight.grad = layer.bias.grad = x.grad = None
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=5120)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--record", metavar="DEVICE", help="write the forward's ratios as the planner's factors")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layers = block_linears(args.width)
    check({f"{name}.weight": layer for name, layer in layers.items()}, device, torch.bfloat16)  # refused by name
    layers = {name: layer.to(device, torch.bfloat16) for name, layer in layers.items()}
    records, dense_total, sparse_total = [], 0.0, 0.0
    for name, layer in layers.items():
        with torch.no_grad():
            layer.weight.mul_(transposable_mask(layer.weight.abs(), 2, 4))
        x = torch.randn(args.tokens, layer.in_features, device=device, dtype=torch.bfloat16, requires_grad=True)
        outputs = {}
        for kernels in (False, True):
            use_kernels(layer, kernels)
            out = layer(x)
            out.backward(torch.ones_like(out))
            outputs[kernels] = (out.detach().float(), x.grad.float())
            x.grad = layer.weight.grad = layer.bias.grad = None
        for dense, sparse in zip(outputs[False], outputs[True]):
            error = ((sparse - dense).norm() / dense.norm()).item()
            assert error < 2e-2, f"{name}: the kernels' result is {error:.1e} from the dense masked GEMM's"
        times = {}
        for kernels, backward in itertools.product((False, True), (True, False)):
            use_kernels(layer, kernels)
            times[kernels, backward] = timed(layer, x, args.warmup, args.iters, backward)
        use_kernels(layer, False)
        dense_ms, sparse_ms = times[False, True], times[True, True]
        dense_total, sparse_total = dense_total + dense_ms, sparse_total + sparse_ms
        shape = shape_key(args.tokens, layer.in_features, layer.out_features)
        forward = times[False, False] / times[True, False]
        records.append(
            {"matrix": name, "shape": shape, "dense_ms": dense_ms, "sparse_ms": sparse_ms, "forward_speedup": forward}
        )
        print(
            f"{name:10s} {shape:24s} dense {dense_ms:7.3f} ms  2:4 {sparse_ms:7.3f} ms  x{dense_ms / sparse_ms:.2f}"
            f"  (forward alone x{forward:.2f})"
        )
    print(f"block      dense {dense_total:.3f} ms  2:4 {sparse_total:.3f} ms  x{dense_total / sparse_total:.2f}")
    print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(device), "records": records}, indent=1))
    if args.record:  # the planner's one source for the factor (merged: other shapes and devices kept)
        table = json.loads(TABLE.read_text()) if TABLE.is_file() else {}
        entry = table.setdefault(args.record, {"speedup": {}})
        entry["speedup"].update({r["shape"]: round(r["forward_speedup"], 3) for r in records})
        entry["measured"] = f"{datetime.date.today()}, {torch.cuda.get_device_name(device)}, torch {torch.__version__}"
        TABLE.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
