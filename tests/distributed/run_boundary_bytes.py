"""A 2-stage tiny GPT under bf16-mixed, run by ``PipelineEngine`` on the ``Run`` that ``pd2bw-train``'s checks
resolve, beside the planner's transport term for the same configuration: ``OUT/boundary-{NAME}-rank{R}.json``.

Usage: torchrun --nproc-per-node=2 run_boundary_bytes.py OUT NAME [OVERRIDE ...] (Hydra overrides of the tiny
recipe, e.g. ``strategy.boundary_dtype=null``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir

from lightning_pd2bw import PipelineEngine
from lightning_pd2bw.cli.checks import check_run
from lightning_pd2bw.cli.model_profile import build_model_on_meta
from lightning_pd2bw.cli.run_plan import stage_plan
from lightning_pd2bw.cli.train import CONF, RECIPES, setup_hydra
from lightning_pd2bw.engine.materialize import parameters_on_meta

STEPS = 3


def main() -> None:
    out, name, overrides = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    setup_hydra()
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        cfg = compose(config_name="tiny", overrides=[f"hydra.searchpath=[file://{CONF}]", *overrides])
    layout = check_run(cfg)
    meta = build_model_on_meta(cfg)
    _, stages, memories = stage_plan(cfg, layout, meta)  # the planner's terms for this run
    run = layout.run.options.replace(layers_per_stage=tuple(len(r) for r in stages)).resolve(
        layout.world_size, str(cfg.trainer.precision)
    )
    torch.manual_seed(0)
    from hydra.utils import instantiate

    model = instantiate(cfg.model)
    with parameters_on_meta():
        model.configure_model()
    engine = PipelineEngine(
        model.pipeline_layers(),
        run,
        model.pipeline_inputs,
        model.pipeline_loss,
        device="cpu",
        init_layer=model.init_pipeline_layer,
        root=model,
    )
    engine.start(torch.optim.SGD(engine.parameters(), lr=1e-3))
    tokens = torch.randint(0, 256, (layout.batch_per_replica, layout.seq_len))
    peaks = []
    for _ in range(STEPS):
        engine.train_batch({"input_ids": tokens, "labels": tokens}, context=torch.autocast("cpu", dtype=torch.bfloat16))
        peaks.append(engine.counters()["peak_transport_bytes"])
    engine.drain()
    rank = dist.get_rank()
    record = {
        "engine_transport_bytes": max(peaks),
        "planned_transport_bytes": memories[rank]["transport"],
        "boundary_dtype": str(run.boundary_dtype),
    }
    (out / f"boundary-{name}-rank{rank}.json").write_text(json.dumps(record))
    engine.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
