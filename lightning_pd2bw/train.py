"""Hydra entry point: ``pd2bw-train [recipe=NAME] [overrides...]`` (also ``python -m lightning_pd2bw.train``).

``recipe=NAME`` selects ``recipes/NAME.yaml`` (default: ``tiny``), a whole experiment built on
``conf/config.yaml``. The configuration is checked (``config.check_run``) before any process starts;
``dry_run=true`` prints the plan (stages, parameters, batch layout, memory) from the meta device and
stops. Lightning's launcher re-runs this command in each rank with ``hydra.run.dir`` pinned, so all
ranks share one output directory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONF, RECIPES = ROOT / "conf", ROOT / "recipes"


def register_resolvers() -> None:
    """``${mul:a,b}`` (an int: steps from fractions of training) and ``${max:a,b}`` for the configs."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("mul"):
        OmegaConf.register_new_resolver("mul", lambda a, b: int(a * b))
    if not OmegaConf.has_resolver("max"):
        OmegaConf.register_new_resolver("max", lambda a, b: max(a, b))


def setup_hydra() -> None:
    from .config import register_schemas

    register_resolvers()
    register_schemas()


def recipe_names() -> list[str]:
    return sorted(p.stem for p in RECIPES.glob("*.yaml"))


def _select_recipe(argv: list[str]) -> list[str]:
    """Turn ``recipe=NAME`` into Hydra's ``--config-name NAME`` (recipes are primary configs)."""
    out, recipe = [], "tiny"
    for arg in argv:
        if arg.startswith("recipe="):
            recipe = arg.split("=", 1)[1]
        else:
            out.append(arg)
    if "--config-name" in out or any(a.startswith("--config-name=") for a in out):
        return out
    if recipe not in recipe_names():
        raise SystemExit(f"recipe={recipe!r} is not a recipe; valid: {', '.join(recipe_names())}")
    return ["--config-name", recipe, *out, f"hydra.searchpath=[file://{CONF}]"]


def sparsity_config(cfg):
    """The sparsity group's node, or None for ``sparsity=none`` (a recipe's leftover keys without a
    ``_target_``, e.g. tiny's ``sparsity.sparsity: 0.5``, do not switch it on)."""
    node = cfg.get("sparsity")
    return node if node and "_target_" in node else None


def build_model_on_meta(cfg):
    """The whole model on the meta device: shapes and parameter counts, no memory."""
    import torch
    from hydra.utils import instantiate

    model = instantiate(cfg.model)
    with torch.device("meta"):
        model.configure_model()
    return model


def plan_text(cfg, layout, model) -> str:
    """What matters at start-up (and all a dry run prints): stages, layers, parameters, batches, memory."""
    from hydra.utils import instantiate

    from .memory import GiB, estimate_stage
    from .models.transformer import Block
    from .pipeline.partition import balanced_partition, layer_parameter_counts
    from .strategy import pipeline_layers_of

    layers = pipeline_layers_of(model)
    counts = layer_parameter_counts(layers)
    stages = balanced_partition(counts, layout.num_stages)
    config = instantiate(cfg.model.config)
    total = sum(p.numel() for p in model.parameters())
    lines = [
        f"model: {type(model).__name__} {cfg.model.config.name}: {total:,} parameters ({total / 1e9:.2f}B), "
        f"{len(layers)} pipeline layers",
        f"layout: {layout.world_size} processes = {layout.num_stages} stages x {layout.data_parallel_size} replicas; "
        f"mode={cfg.strategy.mode} recompute={cfg.strategy.recompute} precision={cfg.trainer.precision}",
        f"batch: global {layout.global_batch_size} = {layout.data_parallel_size} replicas x "
        f"{layout.num_microbatches} microbatches x {layout.micro_batch_size} sequences; "
        f"tokens per step = {layout.global_batch_size} x {layout.seq_len} = {layout.tokens_per_step:,}",
    ]
    if (sparsity := sparsity_config(cfg)) is not None:
        lines.append(f"sparsity: {sparsity._target_.rsplit('.', 1)[-1]} to {sparsity.sparsity:.0%} of the targets")
    for stage, span in enumerate(stages):
        params = sum(counts[i] for i in span)
        blocks = sum(isinstance(layers[i], Block) for i in span)
        memory = estimate_stage(
            params,
            blocks,
            stage,
            layout.num_stages,
            layout.num_microbatches,
            seq=layout.seq_len,
            micro=layout.micro_batch_size,
            hidden=config.n_embd,
            heads=config.n_head,
            vocab=config.vocab_size,
            has_head=span.stop == len(layers),
            mode=cfg.strategy.mode,
            recompute=cfg.strategy.recompute,
            precision=cfg.trainer.precision,
            optimizer=cfg.model.optimizer,
        )
        lines.append(
            f"  stage {stage}: layers {span.start}..{span.stop - 1} ({blocks} blocks), {params:,} parameters, "
            f"est. memory {memory.total / GiB:.2f} GiB (weights {memory.weights / GiB:.2f}, grads "
            f"{memory.gradients / GiB:.2f}, optimizer {memory.optimizer / GiB:.2f}, activations "
            f"{memory.activations / GiB:.2f})"
        )
    return "\n".join(lines)


def run(cfg) -> dict:
    import lightning.pytorch as pl
    import torch
    from hydra.utils import instantiate
    from lightning.pytorch.callbacks import ModelCheckpoint
    from omegaconf import OmegaConf

    import lightning_pd2bw  # noqa: F401  (registers the strategy)

    from .callbacks import RunMetrics
    from .config import check_run

    _pin_output_dir(cfg)
    layout = check_run(cfg)  # before any process or process group exists
    if cfg.dry_run:
        model = build_model_on_meta(cfg)
        check_run(cfg, num_layers=len(model.pipeline_layers()))
        text = plan_text(cfg, layout, model)
        print(f"dry run (nothing allocated, no process started)\n{text}")
        return {"dry_run": True}
    torch.set_num_threads(max(1, torch.get_num_threads() // max(1, layout.world_size // cfg.trainer.num_nodes)))
    pl.seed_everything(cfg.seed, workers=True)
    model = instantiate(cfg.model)
    data = instantiate(cfg.data, batch_size=layout.batch_per_replica)
    strategy = instantiate(cfg.strategy, num_microbatches=layout.num_microbatches)
    logger = instantiate(cfg.logger) if cfg.get("logger") else False
    callbacks = [RunMetrics(layout.global_batch_size, layout.seq_len)]
    for node in (cfg.get("callbacks") or {}).values():
        callback = instantiate(node) if node else None
        # trainer.enable_checkpointing=false switches the checkpoint callback off instead of clashing with it
        if callback is not None and (cfg.trainer.enable_checkpointing or not isinstance(callback, ModelCheckpoint)):
            callbacks.append(callback)
    if (sparsity := sparsity_config(cfg)) is not None:
        callbacks.append(instantiate(sparsity))
    trainer = instantiate(cfg.trainer, strategy=strategy, logger=logger, callbacks=callbacks)
    out = Path(cfg.paths.output_dir)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    if trainer.is_global_zero:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
        print(plan_text(cfg, layout, build_model_on_meta(cfg)))
    if logger:
        logger.log_hyperparams(resolved)  # the resolved config, no ${...} strings
    trainer.fit(model, datamodule=data, ckpt_path=cfg.ckpt_path)
    summary = {k: float(v) for k, v in trainer.callback_metrics.items()}
    summary["global_step"] = trainer.global_step
    if trainer.is_global_zero:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"summary: {json.dumps(summary)}\nrun directory: {out}")
        _finish_wandb(logger)
    return summary


def _pin_output_dir(cfg) -> None:
    """All ranks write to rank 0's directory: Lightning's launcher passes it to the others as
    ``hydra.run.dir`` (``paths.output_dir`` may hold ``${now:...}``, which differs per process)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    if HydraConfig.initialized():
        with open_dict(cfg):
            cfg.paths.output_dir = HydraConfig.get().runtime.output_dir


def _finish_wandb(logger) -> None:
    """Close the wandb run (writes its config and summary files) and say how to upload an offline run."""
    if type(logger).__name__ != "WandbLogger":
        return
    run_dir = Path(logger.experiment.dir).parent
    logger.experiment.finish()
    if logger._offline:
        print(f"wandb offline run: upload with `wandb sync {run_dir}`")


def main() -> None:
    import hydra

    setup_hydra()
    sys.argv = [sys.argv[0], *_select_recipe(sys.argv[1:])]
    hydra.main(version_base="1.3", config_path=str(RECIPES), config_name="tiny")(_main)()


def _main(cfg) -> None:
    from .config import ConfigError

    try:
        run(cfg)
    except ConfigError as error:
        raise SystemExit(f"pd2bw-train: bad configuration: {error}") from None


if __name__ == "__main__":
    main()
