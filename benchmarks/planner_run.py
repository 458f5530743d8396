"""One configuration of the planner-accuracy benchmark, under torchrun (2 CPU processes, 1 thread each).

Rank 0 profiles the model's layers alone (the planner's measured profile), both ranks time messages
between them; the planner predicts samples/s and memory per stage; then the configuration trains
with the real Trainer and pd2bw, timing steady-state steps and the resident-memory growth per rank.
Writes ``OUT/rank-R.json``.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)

import lightning.pytorch as pl  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_pd2bw import PipeDream2BWStrategy  # noqa: E402
from lightning_pd2bw.data import LMDataset, read_corpus  # noqa: E402
from lightning_pd2bw.engine.options import PipelineOptions  # noqa: E402
from lightning_pd2bw.models import GPT, GPTConfig  # noqa: E402
from lightning_pd2bw.planner import Candidate, ClusterSpec, DeviceSpec, predict  # noqa: E402
from lightning_pd2bw.planner.auto import measure_link, shared_layers  # noqa: E402
from lightning_pd2bw.planner.cost import ModelProfile  # noqa: E402
from lightning_pd2bw.planner.measure import measure_layers  # noqa: E402
from lightning_pd2bw.planner.search import partition  # noqa: E402

SEQ, GLOBAL_BATCH, WARMUP, TIMED = 128, 16, 3, 8
CONFIG = GPTConfig(n_layer=6, n_head=4, n_embd=256, block_size=SEQ)


def rss() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class StepTimer(pl.Callback):
    def __init__(self) -> None:
        self.marks: list[float] = []

    def on_train_batch_end(self, *args: object) -> None:
        self.marks.append(time.perf_counter())


def main() -> None:
    width, depth, micro, recompute, mode, clip = json.loads(sys.argv[1])
    out = Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    candidate = Candidate.of(PipelineOptions(mode=mode), width, depth, micro, recompute)  # the strategy's run
    m = candidate.num_microbatches(GLOBAL_BATCH)
    data = LMDataset(read_corpus(max_bytes=2_000_000), SEQ)
    latency, bandwidth = measure_link(1, torch.device("cpu"))
    stages = planned_cut(candidate, m, data)  # the planner's cut from a quick profile of one rank
    # the real run first (its memory is measured from here), then the full profile
    pl.seed_everything(0)
    model = GPT(CONFIG, lr=1e-3)
    timer = StepTimer()
    trainer = pl.Trainer(
        strategy=PipeDream2BWStrategy(
            num_stages=depth,
            num_microbatches=m,
            mode=mode,
            recompute=recompute,
            layers_per_stage=[len(r) for r in stages],
        ),
        accelerator="cpu",
        devices=2,
        max_steps=WARMUP + TIMED,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
        limit_val_batches=0,
        gradient_clip_val=1.0 if clip else None,
    )
    before = rss()
    trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=GLOBAL_BATCH // width, shuffle=True))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    elapsed = timer.marks[-1] - timer.marks[WARMUP - 1]
    stage = trainer.strategy.grid.stage
    del trainer, model
    # the planner's measured profile: every layer alone, both processes profiling at once (as they train)
    profile = measured_profile(micro, data)
    cluster = ClusterSpec(DeviceSpec("cpu", 0.0, 8 * 2**30, 0.0), 1, 2, bandwidth, bandwidth, latency, name="2 x cpu")
    prediction = predict(profile, candidate, cluster, GLOBAL_BATCH, stages)
    record = {
        "config": {
            "width": width,
            "depth": depth,
            "micro": micro,
            "recompute": recompute,
            "mode": mode,
            "m": m,
            "clip": clip,
        },
        "stage": stage,
        "measured_samples_per_sec": GLOBAL_BATCH * TIMED / elapsed,
        "predicted_samples_per_sec": prediction.throughput,
        "measured_memory": peak - before,
        "predicted_memory": [sum(m.values()) for m in prediction.stage_memory],
        "predicted_stage_times": prediction.stage_times,
        "predicted_update": prediction.update_time,
        "measured_step_s": elapsed / TIMED,
        "link": {"latency_s": latency, "bandwidth": bandwidth},
        "stages": [[r.start, r.stop] for r in stages],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{rank}.json").write_text(json.dumps(record, indent=1))


def measured_profile(micro: int, data: LMDataset, repeats: int = 5) -> ModelProfile:
    pl.seed_everything(0)
    model = GPT(CONFIG, lr=1e-3)
    layers = list(model.pipeline_layers())
    batch = next(iter(DataLoader(data, batch_size=micro)))
    profiles = measure_layers(
        layers,
        batch["input_ids"],
        torch.device("cpu"),
        loss_fn=lambda output: model.pipeline_loss(output, batch),
        repeats=repeats,
    )
    return ModelProfile(profiles, 4, 2, shared_layers(layers), communicator_bytes=0.0)  # gloo: no NCCL buffers


def planned_cut(candidate: Candidate, m: int, data: LMDataset) -> list[range]:
    """Rank 0's time-balanced cut, the same on both ranks."""
    message = [partition(measured_profile(candidate.micro_batch_size, data, 1), candidate, m, float("inf"))]
    dist.broadcast_object_list(message, src=0)
    return message[0]


if __name__ == "__main__":
    main()
