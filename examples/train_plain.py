"""The pipeline without Lightning: PipelineEngine in a plain PyTorch loop, a small GPT on the embedded corpus.

torchrun --standalone --nproc-per-node 2 examples/train_plain.py              # 2 stages
torchrun --standalone --nproc-per-node 4 examples/train_plain.py --stages 2   # 2 stages x 2 replicas
"""

import argparse
import math
import os

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from lightning_pd2bw.data import LMDataset, read_corpus, split
from lightning_pd2bw.engine import Clipping, PipelineEngine, PipelineOptions
from lightning_pd2bw.engine.materialize import parameters_on_meta
from lightning_pd2bw.models import GPTConfig, GPTCore


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", type=int, default=None, help="pipeline depth (default: every process)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--mode", default="2bw", choices=["2bw", "flush", "gpipe"])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16, help="samples per replica and step")
    parser.add_argument("--out", default=None, help="write each rank's engine.state_dict() here")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo")
    stages = args.stages or dist.get_world_size()

    config = GPTConfig.from_name("tiny")
    with parameters_on_meta():  # no memory until each stage materialises its own layers
        model = GPTCore(config)
    engine = PipelineEngine(
        model.pipeline_layers(),
        PipelineOptions(
            num_stages=stages,
            num_microbatches=args.microbatches,
            mode=args.mode,
            clipping=Clipping(1.0),  # by the norm over the whole pipeline, as Trainer(gradient_clip_val=1.0)
        ),
        model.pipeline_inputs,
        model.pipeline_loss,
        init_layer=model.init_pipeline_layer,  # the same weights as the model built on one device
        root=model,  # checkpoint entries by the module's names: the same as the Lightning strategy's
    )
    optimizer = torch.optim.AdamW(engine.parameters(), lr=3e-3, weight_decay=0.01)
    engine.start(optimizer)
    warmup = 10
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * (0.55 + 0.45 * math.cos(math.pi * s / args.steps))
    )

    train, val = split(read_corpus(max_bytes=400_000), val_fraction=0.05)
    width, replica = engine.grid.data_parallel_size, engine.grid.replica
    dataset = LMDataset(train, config.block_size)
    sampler = DistributedSampler(dataset, num_replicas=width, rank=replica, shuffle=True, seed=0)  # a shard each
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    step, batches = 0, iter(loader)
    while step < args.steps:
        loss = engine.train_batch(next(batches))  # 2BW: the previous batch's loss (None first)
        scheduler.step()
        step += 1
        if loss is not None and step % 10 == 0 and dist.get_rank() == 0:
            print(f"step {step} train_loss {loss.item():.4f}", flush=True)
    last = engine.drain()  # 2BW: the update in flight, and the last batch's loss (flush: None)
    last = last if last is not None else loss
    val_batch = next(iter(DataLoader(LMDataset(val, config.block_size), batch_size=args.batch_size)))
    metrics = engine.evaluate(val_batch)
    print(f"rank {dist.get_rank()}: final train_loss {last.item():.4f} val_loss {metrics['loss']:.4f}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        torch.save(engine.state_dict(), os.path.join(args.out, f"rank-{dist.get_rank()}.pt"))
    engine.close()  # a barrier (every rank has consumed what the others sent), then the engine's own groups go
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
