"""The planner's counted activations against the GPU: one GPT-13B block, and a profile of one microbatch.

    python benchmarks/gpu_activations.py                 # 13B's block (5120 wide, 40 heads, seq 2048), micro 1 and 2

For each microbatch size, one block with bfloat16 weights (the pipeline's weight versions) on a bfloat16 input under
``autocast(bfloat16)`` (Lightning's ``bf16-mixed``):

- ``counted``: what the dry run, ``pd2bw-plan`` and the planner use (``planner/saved_bytes.py``: fake CPU tensors,
  nothing allocated);
- ``hooks``: the same count on the real CUDA forward (``saved_tensors_hooks``, unique storages, parameters excluded);
- ``allocated``: ``torch.cuda.memory_allocated`` after the forward less before it, less the output, plus the input
  (which the graph keeps but was allocated before): what the graph holds, by the allocator;
- ``formula``: Korthikanti et al.'s ``s*b*h*(34 + 5*a*s/h)`` (the planner's source before 0.6.0).

Then ``--profile``: ``torch.profiler`` over one microbatch of a ``--layers``-block slice (forward, backward with
the float32 main-gradient accumulation the engine does, and a fused AdamW step over the float32 master), CUDA time
by kind: GEMMs, attention, gradient accumulation, optimizer, the rest.
"""

from __future__ import annotations

import argparse
import copy

import torch

from lightning_pd2bw.engine.materialize import parameters_on_meta
from lightning_pd2bw.models import GPT, GPTConfig
from lightning_pd2bw.planner.profile import block_activation_bytes
from lightning_pd2bw.planner.saved_bytes import count_layers

MiB = 2**20


def block_of(config: GPTConfig, device: str) -> torch.nn.Module:
    model = GPT(config)
    with parameters_on_meta():
        model.configure_model()
    block = model.pipeline_layers()[1]
    if device == "meta":
        return block
    return copy.deepcopy(block).to_empty(device=device).to(torch.bfloat16)


def compare(config: GPTConfig, micro: int) -> dict:
    seq, width = config.block_size, config.n_embd
    meta = block_of(config, "meta")
    x_meta = torch.empty(micro, seq, width, dtype=torch.bfloat16, device="meta")
    counted = count_layers([meta], x_meta, weight_dtype=torch.bfloat16, autocast_dtype=torch.bfloat16)[0].saved
    block = block_of(config, "cuda")
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(micro, seq, width, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    hooks = count_layers([block], x, autocast_dtype=torch.bfloat16, fake=False)[0].saved
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = block(x)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    peak = torch.cuda.max_memory_allocated() - before
    allocated = held - out.numel() * out.element_size() + x.numel() * x.element_size()
    out.float().sum().backward()
    formula = block_activation_bytes(seq, micro, width, config.n_head, 2)
    return dict(micro=micro, counted=counted, hooks=hooks, allocated=allocated, peak=peak, formula=formula)


def profile(config: GPTConfig, layers: int, micro: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    blocks = [block_of(config, "cuda") for _ in range(layers)]
    params = [p for b in blocks for p in b.parameters()]
    for p in params:
        torch.nn.init.normal_(p, std=0.02)
    master = [p.detach().float().requires_grad_() for p in params]  # the float32 master the optimizer steps
    for m in master:
        m.grad = torch.zeros_like(m)
    optimizer = torch.optim.AdamW(master, lr=1e-4, fused=True)
    x = torch.randn(micro, config.block_size, config.n_embd, dtype=torch.bfloat16, device="cuda", requires_grad=True)

    def microbatch() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            h = x
            for b in blocks:
                h = b(h)
        h.float().sum().backward()
        for p, m in zip(params, master):  # the engine's float32 main gradients
            m.grad.add_(p.grad)
            p.grad = None
        optimizer.step()

    for _ in range(3):
        microbatch()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        microbatch()
        torch.cuda.synchronize()
    kinds: dict[str, float] = {}
    for event in prof.key_averages():
        name = event.key.lower()
        us = event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
        if us <= 0:
            continue
        if any(k in name for k in ("gemm", "xmma", "cutlass", "matmul", "sm90")) and "flash" not in name:
            kind = "GEMM"
        elif any(k in name for k in ("flash", "fmha", "attention", "sdpa")):
            kind = "attention"
        elif "adam" in name:
            kind = "optimizer (fused AdamW, float32 master)"
        else:
            kind = "elementwise, norms, casts, gradient accumulation"
        kinds[kind] = kinds.get(kind, 0.0) + us
    total = sum(kinds.values())
    print(f"\nprofile: one microbatch of {layers} blocks, micro {micro}, then one AdamW step ({total / 1e3:.1f} ms)")
    for kind, us in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:<50} {us / 1e3:8.2f} ms  {us / total:6.1%}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt13b")
    parser.add_argument("--micro", default="1,2")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--layers", type=int, default=2, help="blocks in the profiled slice")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_activations.py needs a CUDA device")
    config = GPTConfig.from_name(args.model, n_layer=1)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.model} block: width {config.n_embd}, ")
    print(f"heads {config.n_head}, seq {config.block_size}; bf16 weights, bf16 input, autocast bf16")
    print(
        f"{'micro':>5} | {'counted MiB':>11} {'hooks MiB':>10} {'allocated MiB':>13} | {'counted/alloc':>13} | "
        f"{'formula MiB':>11} {'formula/alloc':>13} | {'fwd peak MiB':>12}"
    )
    for micro in (int(m) for m in args.micro.split(",")):
        r = compare(config, micro)
        print(
            f"{micro:>5} | {r['counted'] / MiB:>11.1f} {r['hooks'] / MiB:>10.1f} {r['allocated'] / MiB:>13.1f} | "
            f"{r['counted'] / r['allocated']:>13.3f} | {r['formula'] / MiB:>11.1f} {r['formula'] / r['allocated']:>13.2f}"
            f" | {r['peak'] / MiB:>12.1f}"
        )
        torch.cuda.empty_cache()
    if args.profile:
        profile(config, args.layers, 1)


if __name__ == "__main__":
    main()
