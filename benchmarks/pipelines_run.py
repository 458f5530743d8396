"""One run of the pipeline benchmark: one way of training the same GPT on the same global batch.

    python benchmarks/pipelines_run.py '{"kind": "single", "m": 4}' OUT            # one process
    torchrun --standalone --nproc-per-node=2 benchmarks/pipelines_run.py '{"kind": "2bw", "m": 4}' OUT

``BENCH_DEPTH=1`` runs pd2bw's kinds at depth 1 over every process (replicas only: the gradient buckets' case).
``kind``: ``single`` (Lightning, one device), ``ddp`` (Lightning DDP), ``gpipe`` / ``1f1b``
(``torch.distributed.pipelining``'s ScheduleGPipe / Schedule1F1B, a plain training loop), ``flush`` /
``2bw`` (Lightning + pd2bw; ``2bw+ef`` with the delay correction, ``2bw+la`` with ``lookahead=1``, ``2bw+compile`` and
``flush+compile`` with ``compile=True``: inductor, per layer; its compilation falls in the warm-up steps). The global batch is ``m`` microbatches of ``MICRO`` sequences; the
pipelines use depth = processes and ``m`` microbatches. Each rank writes ``OUT/rank-R.json``: steady-
state samples/s (steps after ``WARMUP``), weight bytes it holds (x versions), the peak bytes autograd
held for backward (``ActivationMeter``), and for pd2bw the bubble fraction from the timeline.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_pd2bw import PipeDream2BWStrategy  # noqa: E402
from lightning_pd2bw.data import LMDataset, read_corpus  # noqa: E402
from lightning_pd2bw.lightning.trace import PipelineTrace  # noqa: E402
from lightning_pd2bw.models import GPT, GPTConfig  # noqa: E402
from lightning_pd2bw.observe.activations import ActivationMeter  # noqa: E402
from lightning_pd2bw.observe.timeline import bubble_fraction  # noqa: E402

SEQ = int(os.environ.get("BENCH_SEQ", 128))
MICRO = int(os.environ.get("BENCH_MICRO", 4))
WARMUP, TIMED = int(os.environ.get("BENCH_WARMUP", 2)), int(os.environ.get("BENCH_TIMED", 5))
CONFIG = GPTConfig(
    n_layer=int(os.environ.get("BENCH_LAYERS", 8)),
    n_head=8,
    n_embd=int(os.environ.get("BENCH_WIDTH", 384)),
    block_size=SEQ,
)
LR = 1e-4
ACCELERATOR = os.environ.get("BENCH_ACCELERATOR", "cpu")  # "gpu": one process per GPU, NCCL


def weight_bytes(params: list[nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in dict.fromkeys(params))


def even_cut(num_layers: int, depth: int) -> list[int]:
    """Embedding + blocks + head: the blocks split evenly, embedding on the first stage, head on the last."""
    blocks = num_layers - 2
    sizes = [blocks // depth + (1 if s < blocks % depth else 0) for s in range(depth)]
    sizes[0] += 1
    sizes[-1] += 1
    return sizes


class Probe(pl.Callback):
    """Step marks; activation bytes for the plain strategies (one forward and backward per step)."""

    def __init__(self, meter: ActivationMeter) -> None:
        self.meter = meter
        self.marks: list[float] = []
        self._hooks: Any = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.meter.exclude(pl_module.parameters())
        engine = getattr(trainer.strategy, "engine", None)
        if engine is not None:
            engine.observe(meter=self.meter)

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if getattr(trainer.strategy, "engine", None) is None:
            self._hooks = self.meter.hooks()
            self._hooks.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks = None
        self.marks.append(time.perf_counter())


def lightning_run(kind: str, m: int, data: LMDataset, trace: bool, out: Path) -> dict:
    pl.seed_everything(0)
    model = GPT(CONFIG, lr=LR)
    world = int(os.environ.get("WORLD_SIZE", 1))
    depth = int(os.environ.get("BENCH_DEPTH", world))  # pipeline depth (default: every process); width = world // depth
    meter = ActivationMeter()
    probe = Probe(meter)
    callbacks: list[pl.Callback] = [probe]
    tracer = None
    if kind in ("flush", "2bw", "2bw+ef", "2bw+la", "2bw+compile", "flush+compile"):
        strategy: Any = PipeDream2BWStrategy(
            num_stages=depth,
            num_microbatches=m,
            mode="flush" if kind.startswith("flush") else "2bw",
            compile=kind.endswith("+compile"),
            delay_correction="error_feedback" if kind == "2bw+ef" else None,
            lookahead=1 if kind == "2bw+la" else 0,
            layers_per_stage=even_cut(len(model.pipeline_layers()), depth),
        )
        batch = m * MICRO
        if trace:
            picture_dir = os.environ.get("BENCH_TRACE_DIR")
            tracer = PipelineTrace(
                dirpath=picture_dir or os.path.join(out, "trace"),
                first_step=WARMUP,
                num_steps=TIMED,
                picture=bool(picture_dir),
            )
            callbacks.append(tracer)
    elif kind == "ddp":
        strategy, batch = "ddp", m * MICRO // world
    else:
        strategy, batch = "auto", m * MICRO
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator=ACCELERATOR,
        devices=world,
        max_steps=WARMUP + TIMED,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        limit_val_batches=0,
    )
    trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=batch, shuffle=False, drop_last=True))
    elapsed = probe.marks[-1] - probe.marks[WARMUP - 1]
    executor = getattr(trainer.strategy, "executor", None)
    if executor is not None:
        params = list(executor.versions.parameters)
        versions = executor.versions.max_versions_held
        stage = executor.stage
    else:
        params, versions, stage = list(model.parameters()), 1, int(os.environ.get("RANK", 0))
    record = {
        "samples_per_sec": m * MICRO * TIMED / elapsed,
        "stage": stage,
        "weight_bytes": weight_bytes(params) * versions,
        "activation_bytes": meter.peak,
    }
    if tracer is not None and tracer.kept_window is not None:
        record["bubble"] = bubble_fraction(tracer.kept, *tracer.kept_window)
        record["max_stashed"] = executor.max_stashed
    return record


def torch_pipelining_run(kind: str, m: int, data: LMDataset) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    gpu = ACCELERATOR == "gpu"
    dist.init_process_group("nccl" if gpu else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if gpu else torch.device("cpu")
    pl.seed_everything(0)
    model = GPT(CONFIG, lr=LR)
    layers = list(model.pipeline_layers())
    sizes = even_cut(len(layers), world)
    start = sum(sizes[:rank])
    module = nn.Sequential(*layers[start : start + sizes[rank]]).to(device)
    tied = model.pipeline_layers()[0].wte.weight  # the token embedding, tied to the output head
    holds_tied = rank in (0, world - 1)
    tied_group = dist.new_group(sorted({0, world - 1})) if world > 1 else None  # every rank joins new_group
    stage = PipelineStage(module, rank, world, device)

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return model.pipeline_loss(logits, {"labels": labels})

    schedule = (ScheduleGPipe if kind == "gpipe" else Schedule1F1B)(stage, n_microbatches=m, loss_fn=loss_fn)
    optimizer = torch.optim.AdamW(list(module.parameters()), lr=LR)
    meter = ActivationMeter(module.parameters())
    loader = iter(DataLoader(data, batch_size=m * MICRO, shuffle=False, drop_last=True))
    marks = []
    for _ in range(WARMUP + TIMED):
        batch = next(loader)
        with meter.hooks():
            if rank == 0:
                schedule.step(batch["input_ids"].to(device))
            elif rank == world - 1:
                schedule.step(target=batch["labels"].to(device))
            else:
                schedule.step()
        if world > 1 and holds_tied:  # the tied embedding's gradient is the sum over both ends
            if tied.grad is None:
                tied.grad = torch.zeros_like(tied)
            dist.all_reduce(tied.grad, group=tied_group)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if gpu:
            torch.cuda.synchronize(device)
        marks.append(time.perf_counter())
    elapsed = marks[-1] - marks[WARMUP - 1]
    record = {
        "samples_per_sec": m * MICRO * TIMED / elapsed,
        "stage": rank,
        "weight_bytes": weight_bytes(list(module.parameters())),
        "activation_bytes": meter.peak,
    }
    dist.destroy_process_group()
    return record


def main() -> None:
    config = json.loads(sys.argv[1])
    out = Path(sys.argv[2])
    kind, m = config["kind"], config["m"]
    data = LMDataset(read_corpus(max_bytes=4_000_000), SEQ)
    if kind in ("gpipe", "1f1b"):
        record = torch_pipelining_run(kind, m, data)
    else:
        record = lightning_run(kind, m, data, config.get("trace", True), out)
    record |= {"kind": kind, "m": m}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{os.environ.get('RANK', 0)}.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
