"""Trains with ``PipelineEngine`` in a plain PyTorch loop under torchrun, with Lightning made unimportable.

``torchrun --nproc-per-node N run_engine.py SPEC OUT``: SPEC (``torch.save``) holds the runs, each with its
layout, model size, optimizer settings and every step's batch per replica (dealt by the test, as the Lightning
runs' sampler deals them). Each rank writes its stage's final tensors, its losses and the Lightning modules
it imported (none).
"""

from __future__ import annotations

import importlib.abc
import sys
from pathlib import Path

BLOCKED = ("lightning", "pytorch_lightning", "lightning_fabric")


class NoLightning(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"{name} is blocked: the engine must run without Lightning", name=name)
        return None


sys.meta_path.insert(0, NoLightning())

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lightning_pd2bw.engine import Clipping, PipelineEngine, PipelineOptions  # noqa: E402
from lightning_pd2bw.engine.comm.transport import StageLink  # noqa: E402
from lightning_pd2bw.engine.materialize import parameters_on_meta  # noqa: E402
from lightning_pd2bw.models import GPTConfig, GPTCore  # noqa: E402
from lightning_pd2bw.models.core import warmup_cosine  # noqa: E402


class CountingLink(StageLink):
    """The user's own transport: StageLink, counting the tensors it sends each way."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sent = {"forward": 0, "backward": 0}

    def send_forward(self, tensors, key, *fused) -> None:
        self.sent["forward"] += 1
        super().send_forward(tensors, key, *fused)

    def send_backward(self, grads, *fused) -> bool:
        self.sent["backward"] += 1
        return super().send_backward(grads, *fused)

    def stage_send(self, peer, tensors, key=None) -> None:  # the ring's (interleaved 1F1B): activations carry a key
        self.sent["forward" if key is not None else "backward"] += 1
        super().stage_send(peer, tensors, key)


def build(
    run: dict, cut: list[int] | None = None
) -> tuple[PipelineEngine, list[torch.optim.Optimizer], torch.optim.lr_scheduler.LambdaLR]:
    """The user's side: a model built on the meta device, an engine, AdamW over the stage's parameters."""
    with parameters_on_meta():
        model = GPTCore(GPTConfig(**run["model"]))
    engine = PipelineEngine(
        model.pipeline_layers(),
        PipelineOptions(
            num_stages=run["num_stages"],
            num_microbatches=run["num_microbatches"],
            mode=run["mode"],
            virtual_stages=run["virtual_stages"],
            layers_per_stage=cut,
            delay_correction=None,  # the reference is the plain 2BW rule
            sync_steps=run["sync_steps"],  # 0: the paper's 2BW from the first step (the default starts with 250)
            clipping=Clipping(run["clip"], run["clip_algorithm"]),
        ),
        model.pipeline_inputs,
        model.pipeline_loss,
        device="cpu",
        init_layer=model.init_pipeline_layer,
        transport=CountingLink,
    )
    params = engine.parameters()
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": run["weight_decay"]},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=run["lr"], betas=(0.9, 0.95))
    engine.start(optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, run["warmup_steps"], run["max_steps"], 0.1)
    )
    return engine, optimizer, scheduler


def train(run: dict, out: Path) -> None:
    engine, _, scheduler = build(run)
    losses = []
    for step, replicas in enumerate(run["batches"]):
        if step in run["restart_at"]:  # save, build everything anew, load: the run goes on as if uninterrupted
            losses.append(engine.drain())  # 2BW: the last batch's loss, not returned by train_batch yet
            if run["reshard_to"] is not None:  # the sharded checkpoint, loaded at another cut
                path = out / f"{run['name']}-step{step}"
                engine.save(path, extra={"scheduler": scheduler.state_dict()})
                old_cut = engine.stage_layers
                engine, _, scheduler = build(run, run["reshard_to"])
                assert engine.stage_layers != old_cut
                scheduler.load_state_dict(engine.load(path)["scheduler"])
            else:  # one rank's state, into the same layout
                state = engine.state_dict()
                scheduler_state = scheduler.state_dict()
                engine, _, scheduler = build(run)
                engine.load_state_dict(state)
                scheduler.load_state_dict(scheduler_state)
        loss = engine.train_batch(replicas[engine.grid.replica])
        scheduler.step()
        losses.append(loss)
    losses.append(engine.drain())
    evaluation = engine.evaluate(run["batches"][0][engine.grid.replica])
    state = engine.state_dict()["layers"]
    torch.save(
        {
            "weights": {f"layers.{k}": v for k, v in state.items()},
            "losses": [None if loss is None else loss.item() for loss in losses],  # train_batch's, drain()'s
            "evaluation": evaluation,
            "sent": engine.executor.link.sent,  # the last engine's (after a restart: from there on)
        },
        out / f"{run['name']}-rank{dist.get_rank()}.pt",
    )


def main() -> None:
    spec, out = Path(sys.argv[1]), Path(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for run in torch.load(spec, weights_only=False)["runs"]:
        train(run, out)
    imported = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    torch.save(imported, out / f"imported-rank{dist.get_rank()}.pt")
    dist.barrier()  # every rank has consumed what the others sent before any tears its groups down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
