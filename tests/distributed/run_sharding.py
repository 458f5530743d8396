"""The optimizer sharded over replicas against the same run unsharded: ``torchrun --nproc-per-node=4 ... OUT``.

A plain ``PipelineEngine`` over the tiny ``GPTCore`` at depth 2 x width 2 (2BW, AdamW, the predictive delay
correction, clipping) trains ``STEPS`` batches twice from the same weights and data: with ``shard_optimizer=True``
(the default) and ``False``. Each rank writes ``OUT/rank{r}.pt``: both runs' final weights, the names of the
parameters its optimizer kept and its counters, and the planner's stage memory for both runs. Then the same pair
with the weight versions in bfloat16 (``weight_dtype``): sharded, only each parameter's owner keeps its float32
master; the sharded run saves a checkpoint, which an unsharded engine loads back (each rank writes the tensors of
``written.pt``'s names).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402

from lightning_pd2bw.engine import Clipping, PipelineEngine, PipelineOptions  # noqa: E402
from lightning_pd2bw.engine.materialize import parameters_on_meta  # noqa: E402
from lightning_pd2bw.models import GPTConfig, GPTCore  # noqa: E402
from lightning_pd2bw.planner.cost import Candidate, ModelProfile, stage_memory  # noqa: E402
from lightning_pd2bw.planner.profile import LayerProfile  # noqa: E402
from tests.distributed.cases import SEQ_LEN, Case, replica_batch  # noqa: E402

STEPS = 4
CASE = Case("sharding", mode="2bw", steps=STEPS, width=2)


def build(
    shard: bool, weight_dtype: torch.dtype | None, stages: int = 2, shard_gradients: bool = False
) -> tuple[PipelineEngine, PipelineOptions]:
    torch.manual_seed(0)
    with parameters_on_meta():
        core = GPTCore(GPTConfig(n_layer=3, n_head=2, n_embd=16, block_size=SEQ_LEN))
    options = PipelineOptions(
        mode="2bw" if stages > 1 else "flush",  # one stage: data parallelism (2BW refuses it)
        num_stages=stages,
        num_microbatches=stages,
        shard_optimizer=shard,
        shard_gradients=shard_gradients,
        clipping=Clipping(0.5),
        weight_dtype=weight_dtype,
    )
    engine = PipelineEngine(
        core.pipeline_layers(),
        options,
        core.pipeline_inputs,
        core.pipeline_loss,
        device="cpu",
        init_layer=core.init_pipeline_layer,
        root=core,
    )
    engine.start(torch.optim.AdamW(engine.parameters(), lr=3e-3, weight_decay=0.01))
    return engine, options


def train(
    shard: bool, weight_dtype: torch.dtype | None = None, save: Path | None = None, shard_gradients: bool = False
) -> dict:
    engine, options = build(shard, weight_dtype, shard_gradients=shard_gradients)
    replica = engine.grid.replica
    for step in range(STEPS):
        context = torch.autocast("cpu", dtype=weight_dtype, cache_enabled=False) if weight_dtype else None
        engine.train_batch(replica_batch(CASE, step, replica, 2), context=context)
    engine.drain()
    counters = engine.counters()
    names = engine.parameter_names()
    stepped = sorted(names[id(p)][0] for o in engine.optimizers for g in o.param_groups for p in g["params"])
    weights = {k: v.detach().clone() for k, v in engine.stage_state_dict().items()}
    params = [(names[id(p)][0], p.numel()) for p in engine.params]
    tied = [names[id(s.param)][0] for s in engine.shared]  # outside the buckets: summed over the stages
    written = sorted(engine.written_state_dict())
    written_dtypes = sorted({str(v.dtype) for v in engine.written_state_dict().values()})
    if save is not None:
        engine.save(save)
    engine.close()
    # the planner's terms for this stage: its parameters as one layer, AdamW (2 states)
    profile = ModelProfile([LayerProfile(0.0, 0.0, 0.0, 0.0, sum(n for _, n in params))], 4, 2, communicator_bytes=0.0)
    candidate = Candidate.of(options, 2, 2, 1)
    plan = stage_memory(profile, range(0, 1), engine.stage, candidate, 2)
    return {
        "weights": weights,
        "stepped": stepped,
        "counters": counters,
        "params": params,
        "tied": tied,
        "plan": plan,
        "written": written,
        "written_dtypes": written_dtypes,
    }


def reload(path: Path, shard: bool, stages: int = 2) -> dict[str, torch.Tensor]:
    """A bf16 engine loading the sharded run's checkpoint: unsharded (every replica keeps every float32 master) or
    sharded (each replica its own), at 2 x 2 or resharded (4 x 1, 1 x 4): what it holds, and what it would write."""
    engine, _ = build(shard, torch.bfloat16, stages)
    engine.load(path)
    weights = {k: v.detach().clone() for k, v in engine.stage_state_dict().items()}
    written = {k: v.detach().clone() for k, v in engine.written_state_dict().items()}
    engine.close()
    return {"weights": weights, "written": written}


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    result = {"sharded": train(True), "whole": train(False)}
    result["shard grads"] = train(True, shard_gradients=True)
    result["bf16 shard grads"] = train(True, torch.bfloat16, shard_gradients=True)
    result["bf16 whole"] = train(False, torch.bfloat16)
    result["bf16 sharded"] = train(True, torch.bfloat16, save=out / "bf16.ckpt")
    result["bf16 reloaded"] = reload(out / "bf16.ckpt", shard=False)
    result["bf16 reloaded sharded"] = reload(out / "bf16.ckpt", shard=True)
    result["bf16 reloaded 4x1"] = reload(out / "bf16.ckpt", shard=True, stages=4)
    result["bf16 reloaded 1x4"] = reload(out / "bf16.ckpt", shard=True, stages=1)
    torch.save(result, out / f"rank{dist.get_rank()}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
