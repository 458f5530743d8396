"""One GPU, ``bf16-mixed``: pd2bw's step against plain Lightning training the same layers.

    python benchmarks/gpu_stage.py                  # GPT-1.3B-shaped stage slice (6 blocks of 2048), m = 4
    python benchmarks/gpu_stage.py --layers 2 --seq 512 --micro 2   # a smaller slice

The model is a GPT with GPT-1.3B's width, heads, context and vocabulary and ``--layers`` blocks (a depth-4
stage of the 24-block model, with the embedding and head of the first and last stage). The same global
batch (``m`` microbatches of ``--micro`` sequences) is trained by

- ``lightning``: plain Lightning on one device, ``accumulate_grad_batches=m`` (the reference step);
- ``flush`` / ``2bw``: ``PipeDream2BWStrategy(num_stages=1, num_microbatches=m)``, the pipeline engine's
  step (executor, weight versions, update path) on one stage, with bfloat16 weight versions over a float32 master
  (``weight_dtype="auto"``, the default);
- ``2bw-casts`` / ``flush-casts``: the same with ``weight_dtype=None`` (float32 weights that autocast casts at every
  microbatch's forward and recompute: the path before 0.4.0);
- ``lightning+compile`` / ``2bw+compile`` / ``flush+compile``: the same with each layer under ``torch.compile``
  (``compile=True``; plain Lightning's layers compiled the same way, per layer, in place). The models' AdamW is
  fused on CUDA in every run.

    python benchmarks/gpu_stage.py --runs lightning+compile,2bw+compile,flush+compile   # issue 36's MFU target

Each run reports the steady-state step time (after ``--warmup`` steps, the device synchronised at each
optimizer step in every run), tokens/s and MFU from Lightning's ``Throughput`` with the device's peak from
``get_available_flops``, ``torch.cuda.max_memory_allocated`` (less what was allocated before the run), and for the pipeline runs the planner's
predicted memory of the stage (``planner.cost.stage_memory`` over the layers as ``plan="auto"`` profiles
them on this device). Prints one table; ``--json PATH`` writes the records.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.throughput import Throughput, get_available_flops
from torch.utils.data import DataLoader, Dataset

from lightning_pd2bw import PipeDream2BWStrategy
from lightning_pd2bw.engine.compiled import compile_layers
from lightning_pd2bw.engine.materialize import parameters_on_meta
from lightning_pd2bw.engine.options import PipelineOptions
from lightning_pd2bw.engine.precision import Precision
from lightning_pd2bw.models import GPT, GPTConfig
from lightning_pd2bw.planner.auto import sample_microbatch, shared_layers
from lightning_pd2bw.planner.candidate import planning_run
from lightning_pd2bw.planner.cost import Candidate, ModelProfile, stage_memory
from lightning_pd2bw.planner.measure import measure_layers
from lightning_pd2bw.planner.saved_bytes import count_layers

GiB = 2**30


class RandomTokens(Dataset):
    """Random token windows (the step's cost does not depend on the text)."""

    def __init__(self, count: int, seq: int, vocab: int) -> None:
        self.tokens = torch.randint(0, vocab, (count, seq + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index, :-1], "labels": self.tokens[index, 1:]}


class StepClock(pl.Callback):
    """Marks the end of every optimizer step, with the device synchronised (the same in every run)."""

    def __init__(self, accumulate: int) -> None:
        self.accumulate = accumulate
        self.marks: list[float] = []
        self.peaks: list[int] = []  # max_memory_allocated at the start of training, then at each step's end

        self.counters: dict[str, int] = {}  # the engine's own terms at the last step's end (pipeline runs)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.peaks.append(accel().max_memory_allocated())

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % self.accumulate == 0:
            accel().synchronize()
            self.marks.append(time.perf_counter())
            self.peaks.append(accel().max_memory_allocated())
            engine = getattr(trainer.strategy, "engine", None)
            if engine is not None:
                self.counters = engine.counters()


def predicted_stage_bytes(
    config: GPTConfig, batch: dict[str, torch.Tensor], micro: int, m: int, options: PipelineOptions, counted: bool
) -> dict[str, float]:
    """The planner's peak for this one-stage pipeline, from layers profiled on the device as ``plan="auto"`` does
    (the layers built on the meta device, each materialised and timed alone, on bfloat16 weights where the run's
    versions are bfloat16)."""
    model = GPT(config)
    with parameters_on_meta():
        model.configure_model()
    layers = list(model.pipeline_layers())
    device = torch.device(DEVICE)
    weight_dtype = planning_run(options, "bf16-mixed").weight_dtype
    versions = Precision.of("bf16-mixed").version_bytes(weight_dtype)
    sample = sample_microbatch(batch, micro, device)
    profiles = measure_layers(
        layers,
        model.pipeline_inputs(sample),
        device,
        loss_fn=lambda out: model.pipeline_loss(out, sample),
        autocast=lambda: torch.autocast(DEVICE, dtype=torch.bfloat16, cache_enabled=False),  # Lightning's setting
        weight_dtype=torch.bfloat16 if versions else None,
    )
    if counted:  # the dry run's and pd2bw-plan's activations: counted on fake tensors, nothing allocated
        tokens = torch.zeros(micro, config.block_size, dtype=torch.long, device="meta")

        def loss(output: torch.Tensor) -> torch.Tensor:
            labels = torch.zeros(micro, config.block_size, dtype=torch.long)  # fake, inside the count
            return model.pipeline_loss(output, {"input_ids": labels, "labels": labels})

        bytes_ = count_layers(
            layers,
            model.pipeline_inputs({"input_ids": tokens}),
            weight_dtype=torch.bfloat16 if versions else None,
            autocast_dtype=torch.bfloat16,
            loss_fn=loss,
        )
        profiles = [replace(p, activation_bytes=float(b.saved)) for p, b in zip(profiles, bytes_)]
    profile = ModelProfile(
        profiles,
        weight_bytes=4,
        optimizer_states=2,
        shared=shared_layers(layers),
        version_bytes=versions,
        optimizer_temporaries=0.0,  # fused AdamW on CUDA (models/optim.py)
    )
    return stage_memory(profile, range(len(layers)), 0, Candidate.of(options, 1, 1, micro, False), m)


def dense_bf16_peak() -> float | None:
    """The device's dense bfloat16 peak: Lightning's table (``get_available_flops``), except for the H200, which it
    does not know by the name ``NVIDIA H200`` and lists with sparsity (2.0e15) under its SXM name: the H200 has the
    H100 SXM's tensor cores and clocks, 989.4 TFLOP/s dense."""
    if DEVICE != "cuda":
        return None
    if "h200" in torch.cuda.get_device_name().lower():
        return 989.4e12
    return get_available_flops(torch.device("cuda"), torch.bfloat16)


class _OnCpu:
    """What the script asks of ``torch.cuda``, answered on the CPU (``--device cpu``: gpu_first.py's CPU mode runs
    every code path at toy sizes; no memory is measured there)."""

    @staticmethod
    def max_memory_allocated() -> int:
        return 0

    memory_allocated = max_memory_allocated

    @staticmethod
    def synchronize() -> None:
        return None

    reset_peak_memory_stats = empty_cache = synchronize

    @staticmethod
    def get_device_name() -> str:
        return "cpu"


DEVICE = "cuda"  # main() sets it from --device


def accel():  # noqa: ANN201 (torch.cuda or its CPU stand-in)
    return torch.cuda if DEVICE == "cuda" else _OnCpu


class CompileLayers(pl.Callback):
    """Plain Lightning's layers compiled as ``compile=True`` compiles a stage's: per layer, in place."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        compile_layers(list(pl_module.pipeline_layers()), {})


def run(kind: str, config: GPTConfig, args: argparse.Namespace, data: Dataset) -> dict[str, Any]:
    pl.seed_everything(0)
    model = GPT(config, lr=1e-4)
    m, micro = args.m, args.micro
    base, compiled = kind.removesuffix("+compile"), kind.endswith("+compile")
    base, casts = base.removesuffix("-casts"), base.endswith("-casts")
    options = PipelineOptions(
        mode="2bw" if base == "lightning" else base,
        weight_dtype=None if casts else "auto",
        lookahead=args.lookahead if base not in ("lightning", "zb_h1") else 0,  # zb_h1: its W fill the cooldown
    )
    callbacks: list[pl.Callback] = []
    if base == "lightning":
        strategy: Any = "auto"
        batch, accumulate = micro, m
        callbacks = [CompileLayers()] if compiled else []
    else:
        strategy = PipeDream2BWStrategy(
            num_stages=1,
            num_microbatches=m,
            mode=base,
            weight_dtype=options.weight_dtype,
            failure_timeout=None,
            compile=compiled,
            lookahead=options.lookahead,
        )
        batch, accumulate = m * micro, 1
    clock = StepClock(accumulate)
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="gpu" if DEVICE == "cuda" else "cpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=args.warmup + args.steps,
        accumulate_grad_batches=accumulate,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock, *callbacks],
    )
    before = accel().memory_allocated()  # what earlier runs left (the process group's buffers, caches)
    accel().reset_peak_memory_stats()
    trainer.fit(model, DataLoader(data, batch_size=batch, shuffle=False, drop_last=True))
    peak = accel().max_memory_allocated() - before
    marks = clock.marks[args.warmup - 1 :]
    step_s = sorted(b - a for a, b in zip(marks, marks[1:]))[len(marks) // 2 - 1]  # median steady-state step
    samples = m * micro
    peak_flops = dense_bf16_peak()
    throughput = Throughput(available_flops=peak_flops, world_size=1, window_size=2)
    flops = model.flops_per_token() * samples * config.block_size  # one step's training FLOPs
    for i in range(2):  # the window of one median step: its rates
        throughput.update(
            time=i * step_s, batches=i, samples=i * samples, lengths=i * samples * config.block_size, flops=flops
        )
    rates = throughput.compute()
    record = {
        "kind": kind,
        "step_s": step_s,
        "tokens_per_sec": rates["device/items_per_sec"],
        "mfu": rates.get("device/mfu"),
        "max_memory_allocated": peak,
        "peak_by_step": [p - before for p in clock.peaks],  # when the peak was reached: setup, step 1, 2, ...
    }
    if base != "lightning":
        sample = next(iter(DataLoader(data, batch_size=micro)))
        measured = predicted_stage_bytes(config, sample, micro, m, options, counted=False)
        counted = predicted_stage_bytes(config, sample, micro, m, options, counted=True)
        record["predicted_bytes"] = float(sum(measured.values()))
        record["predicted_counted_bytes"] = float(sum(counted.values()))
        record["planner_terms"] = counted
        record["counters"] = clock.counters
    print(f"[gpu_stage] {record}", file=sys.stderr, flush=True)
    del trainer, model
    gc.collect()
    accel().empty_cache()
    return record


def roofline_step(config: GPTConfig, args: argparse.Namespace) -> tuple[str, float] | None:
    """The planner's analytic step for this slice (``m`` microbatches, one update) on the device preset named like
    this GPU (``NVIDIA H200`` -> ``h200_141g``), or None where no preset matches: what ``flush`` is checked against."""
    from lightning_pd2bw.planner.hardware import DEVICES
    from lightning_pd2bw.planner.profile import analytic_profile, one_stage_step

    name = accel().get_device_name()
    preset = next((k for k in DEVICES if k.split("_")[0].upper() in name), None)
    if preset is None:
        return None
    layers = analytic_profile(num_blocks=args.layers, hidden=config.n_embd, heads=config.n_head,
                              vocab=config.vocab_size, seq=args.seq, micro=args.micro, device=DEVICES[preset])  # fmt: skip
    return preset, one_stage_step(layers, args.m)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=6, help="transformer blocks in the slice")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro", type=int, default=2, help="sequences per microbatch")
    parser.add_argument("--m", type=int, default=4, help="microbatches per step")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--runs", default="lightning,2bw,flush")
    parser.add_argument("--model", default="gpt1.3b", help="the preset whose width, heads and vocabulary the slice has")
    parser.add_argument(
        "--lookahead", type=int, default=0, help="more forwards in flight: m - 1 holds stage 0's stash of a depth-m run"
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: the code paths at toy sizes")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_stage.py needs a CUDA device (--device cpu runs the code paths on the CPU)")
    config = GPTConfig.from_name(args.model, n_layer=args.layers, block_size=args.seq)
    data = RandomTokens((args.warmup + args.steps + 1) * args.m * args.micro, args.seq, config.vocab_size)
    records = []
    for kind in args.runs.split(","):
        records.append(run(kind, config, args, data))
        if args.json:  # after every run: what finished is kept if a later run fails
            args.json.write_text(json.dumps(records, indent=1))
    print(
        f"\n{accel().get_device_name()}, torch {torch.__version__}; GPT {args.layers} x {config.n_embd} (heads "
        f"{config.n_head}, vocab {config.vocab_size}), seq {args.seq}, microbatch {args.micro}, m = {args.m}, bf16-mixed"
    )
    bases = {r["kind"]: r for r in records if r["kind"].startswith("lightning")}
    print(
        f"{'run':>17} | {'step s':>7} {'vs Lightning':>12} | {'tokens/s':>9} {'MFU':>6} | {'peak GiB':>8} {'planner GiB':>11}"
    )
    for r in records:
        base = bases.get("lightning+compile" if r["kind"].endswith("+compile") else "lightning")
        overhead = f"{r['step_s'] / base['step_s'] - 1:+.1%}" if base else "-"  # against Lightning compiled alike
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        predicted = f"{r['predicted_bytes'] / GiB:.2f}" if "predicted_bytes" in r else "-"
        print(
            f"{r['kind']:>17} | {r['step_s']:>7.4f} {overhead:>12} | {r['tokens_per_sec']:>9.0f} {mfu:>6} | "
            f"{r['max_memory_allocated'] / GiB:>8.2f} {predicted:>11}"
        )
    planned = roofline_step(config, args)
    if planned:
        print(f"  the planner's roofline on {planned[0]}: {planned[1]:.4f} s per step (flush's step, update and all)")
    for r in records:
        if "predicted_bytes" in r and r["max_memory_allocated"]:  # none measured on the CPU
            print(
                f"  {r['kind']}: planner / measured peak {r['predicted_bytes'] / r['max_memory_allocated']:.3f} "
                f"(layers profiled on the device), {r['predicted_counted_bytes'] / r['max_memory_allocated']:.3f} "
                "(activations counted on fake tensors, as the dry run)"
            )
            terms = ", ".join(f"{k} {v / GiB:.2f}" for k, v in r["planner_terms"].items())
            print(f"    planner terms GiB: {terms}")
            held = {k: v for k, v in r["counters"].items() if k.endswith("bytes")}
            print(f"    engine counters GiB: {', '.join(f'{k} {v / GiB:.2f}' for k, v in held.items())}")


if __name__ == "__main__":
    main()
