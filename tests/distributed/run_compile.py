"""Trains the same run twice per rank with ``PipelineEngine``: eager, then with ``compile=...``; writes both.

``torchrun --nproc-per-node N run_compile.py SPEC OUT``: each run of SPEC (``torch.save``) holds a layout, the
compile options, a context (``bf16`` autocast or none) and its batches. The loop has what makes 2BW's compiled
layers see new situations: weight-version swaps at every step, a drain with an evaluation and a prediction in
the middle, more training, a second evaluation and prediction. Each rank writes, per run and engine, its losses,
evaluations, predictions, final tensors and compile counters; then, for the compiled engine only, the counters
after one more batch of another sequence length (a new shape must compile: the meter's positive control).
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_pd2bw.engine import PipelineEngine, PipelineOptions
from lightning_pd2bw.engine.materialize import parameters_on_meta
from lightning_pd2bw.models import GPTConfig, GPTCore


def build(run: dict, compile: dict | None) -> PipelineEngine:
    with parameters_on_meta():
        model = GPTCore(GPTConfig(**run["model"]))
    engine = PipelineEngine(
        model.pipeline_layers(),
        PipelineOptions(
            num_stages=run["num_stages"],
            num_microbatches=run["num_microbatches"],
            mode=run["mode"],
            recompute=run["recompute"],
            boundary_dtype=torch.bfloat16 if run["bf16"] else None,
            compile=compile,
        ),
        model.pipeline_inputs,
        model.pipeline_loss,
        device="cpu",
        init_layer=model.init_pipeline_layer,
    )
    params = engine.parameters()
    engine.start(torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01, foreach=True))
    return engine


def train(run: dict, compile: dict | None) -> dict:
    engine = build(run, compile)
    context = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if run["bf16"] else nullcontext
    losses, evaluations, predictions = [], [], []
    for step, batch in enumerate(run["batches"]):
        if step in run["drain_at"]:
            losses.append(engine.drain())
            for probe in run["probes"]:
                evaluations.append(engine.evaluate(probe, context=context()))
            predictions.append(engine.predict(run["probes"][0], context=context()))
        losses.append(engine.train_batch(batch, context=context()))
    losses.append(engine.drain())
    for probe in run["probes"]:
        evaluations.append(engine.evaluate(probe, context=context()))
    predictions.append(engine.predict(run["probes"][0], context=context()))
    result = {
        "losses": [None if loss is None else loss.item() for loss in losses],
        "evaluations": evaluations,
        "predictions": [p.float() for p in predictions],
        "weights": {k: v.detach().float().clone() for k, v in engine.state_dict()["layers"].items()},
        "counters": dict(engine.compile_meter.counters()) if engine.compile_meter is not None else {},
    }
    if engine.compile_meter is not None:  # positive control: another sequence length compiles after warm-up
        engine.train_batch(run["other_shape"], context=context())
        engine.drain()
        result["counters_after_new_shape"] = dict(engine.compile_meter.counters())
    engine.close()
    return result


def main() -> None:
    spec, out = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for run in torch.load(spec, weights_only=False)["runs"]:
        torch._dynamo.reset()  # each run compiles afresh (a new shape seen by an earlier run would be dynamic here)
        results = {"eager": train(run, None), "compiled": train(run, run["compile"])}
        torch.save(results, out / f"{run['name']}-rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
