"""Hydra entry point: ``pd2bw-train [recipe=NAME] [overrides...]`` (also ``python -m lightning_pd2bw.train``).

``recipe=NAME`` selects ``recipes/NAME.yaml`` (default: ``tiny``), a whole experiment built on
``conf/config.yaml``. The configuration is checked (``config.check_run``) before any process starts;
``dry_run=true`` prints the plan (``run_plan``: stages, parameters, batch layout, memory) from the meta device and
stops. Lightning's launcher re-runs this command in each rank with ``hydra.run.dir`` pinned, so all
ranks share one output directory.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from pathlib import Path

from .run_folder import (  # noqa: F401  (RUN_LOCK, claim_output_dir, run_name: the run folder's, re-exported)
    RUN_LOCK,
    claim_output_dir,
    pin_output_dir,
    resolve_last_checkpoint,
    run_name,
    say,
)

ROOT = Path(__file__).resolve().parents[2]
# an installed wheel carries the configurations in the package (setup.py); a source checkout has them at the top
_PACKAGED = Path(__file__).resolve().parents[1]
CONF = _PACKAGED / "conf" if (_PACKAGED / "conf" / "config.yaml").is_file() else ROOT / "conf"
RECIPES = _PACKAGED / "recipes" if (_PACKAGED / "recipes" / "tiny.yaml").is_file() else ROOT / "recipes"


def register_resolvers() -> None:
    """``${mul:a,b}`` (an int: steps from fractions of training), ``${max:a,b}`` and ``${min:a,b}`` for the configs."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("mul"):
        OmegaConf.register_new_resolver("mul", lambda a, b: int(a * b))
    if not OmegaConf.has_resolver("max"):
        OmegaConf.register_new_resolver("max", lambda a, b: max(a, b))
    if not OmegaConf.has_resolver("min"):
        OmegaConf.register_new_resolver("min", lambda a, b: min(a, b))
    if not OmegaConf.has_resolver("pd2bw_run_name"):
        OmegaConf.register_new_resolver("pd2bw_run_name", run_name, use_cache=True)
    if not OmegaConf.has_resolver("pd2bw_wandb_offline"):
        OmegaConf.register_new_resolver("pd2bw_wandb_offline", wandb_offline)


def wandb_offline() -> bool:
    """``logger=wandb`` runs offline unless the environment asks for uploads, in wandb's own words:
    ``WANDB_MODE=online`` (``offline``/``disabled``/``dryrun``: offline), else ``WANDB_OFFLINE=false``.
    ``logger.offline=false`` overrides both."""
    mode = os.environ.get("WANDB_MODE", "").strip().lower()
    if mode:
        return mode != "online"
    return os.environ.get("WANDB_OFFLINE", "true").strip().lower() not in ("false", "0", "no")


def setup_hydra() -> None:
    from .schemas import register_schemas

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


def run(cfg) -> dict:
    import lightning.pytorch as pl
    import torch
    from hydra.utils import instantiate
    from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
    from omegaconf import OmegaConf

    import lightning_pd2bw  # noqa: F401  (registers the strategy)

    from ..lightning.callbacks import ProgressLog, RunMetrics
    from .checks import check_run, check_tokens
    from .model_profile import build_model_on_meta, sparsity_config
    from .run_length import settle_run_length
    from .run_plan import plan_text, planned_stages

    pin_output_dir(cfg)
    _log_lightning_to_file()
    resolve_last_checkpoint(cfg)
    settle_run_length(cfg)  # max_steps=-1 (epochs): the steps they take, which the schedules read
    auto = cfg.strategy.get("plan") == "auto"
    # checked once, before any process or process group exists: with plan=auto the layout is chosen at start-up;
    # else against the model's layers (built on the meta device: no memory), as the dry run checks it
    meta = None if auto else build_model_on_meta(cfg)
    layout = check_run(cfg, num_layers=None if meta is None else len(meta.pipeline_layers()))
    if cfg.dry_run and auto:
        print(
            "dry run: strategy.plan=auto chooses the layout at start-up from profiles of this machine; preview "
            "plans for a cluster with `pd2bw-plan recipe=NAME cluster=NAME`"
        )
        return {"dry_run": True}
    if cfg.dry_run:
        text = plan_text(cfg, layout, meta)
        say(f"dry run (nothing allocated, no process started)\n{text}")
        return {"dry_run": True}
    check_tokens(cfg)
    claim_output_dir(Path(cfg.paths.output_dir))
    torch.set_num_threads(max(1, torch.get_num_threads() // max(1, layout.world_size // cfg.trainer.num_nodes)))
    pl.seed_everything(cfg.seed, workers=True)
    model = instantiate(cfg.model)
    data = instantiate(cfg.data, batch_size=layout.batch_per_replica)
    start = {"init_from": str(cfg.init_from)} if cfg.get("init_from") else {}  # weights only (lightning/init_from)
    if auto:
        strategy = instantiate(cfg.strategy, global_batch_size=layout.global_batch_size, **start)
    else:
        cut = cfg.strategy.get("layers_per_stage") or [len(r) for r in planned_stages(cfg, layout, meta)]
        strategy = instantiate(
            cfg.strategy,
            num_stages=layout.num_stages,
            num_microbatches=layout.num_microbatches,
            layers_per_stage=cut,
            **start,
        )
    logger = instantiate(cfg.logger) if cfg.get("logger") else False
    callbacks = [RunMetrics(layout.global_batch_size, layout.seq_len)]
    for node in (cfg.get("callbacks") or {}).values():
        callback = instantiate(node) if node else None
        # trainer.enable_checkpointing=false switches the checkpoint callback off instead of clashing with it
        if callback is not None and (cfg.trainer.enable_checkpointing or not isinstance(callback, ModelCheckpoint)):
            callbacks.append(callback)
    if (sparsity := sparsity_config(cfg)) is not None:
        callbacks.append(instantiate(sparsity))
    settings = {}
    if cfg.trainer.enable_progress_bar:  # a bar on a terminal; progress lines in a log (issue 49)
        if sys.stdout.isatty():
            callbacks.append(TQDMProgressBar())  # "Epoch 0: 40%| 60/150": not Rich's "Epoch 0/-2" under max_steps
        else:
            callbacks.append(ProgressLog(cfg.trainer.log_every_n_steps, say))
            settings["enable_progress_bar"] = False
    trainer = instantiate(cfg.trainer, strategy=strategy, logger=logger, callbacks=callbacks, **settings)
    out = Path(cfg.paths.output_dir)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    if sparsity is None:  # sparsity=none: a recipe's leftover keys (tiny's sparsity.sparsity) would read as sparse
        resolved["sparsity"] = None
    if trainer.is_global_zero:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
        say(recipe_line(cfg))
        if not auto:
            say(plan_text(cfg, layout, meta))
    if logger:
        logger.log_hyperparams(resolved)  # the resolved config, no ${...} strings
    trainer.fit(model, datamodule=data, ckpt_path=cfg.ckpt_path)
    summary = run_summary(trainer)
    if trainer.is_global_zero:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        say(f"{end_table(summary)}\nsummary: {out / 'summary.json'}\nrun directory: {out}")
        _finish_wandb(logger)
    return summary


def recipe_line(cfg) -> str:
    """``recipe NAME: what it trains`` and the mode and model this run has (overrides included)."""
    from hydra.core.hydra_config import HydraConfig

    from ..engine.sync_start import mode_line
    from .run_length import sync_steps_of
    from .usage import recipe_description

    name = HydraConfig.get().job.config_name if HydraConfig.initialized() else "?"
    family = str(cfg.model.get("_target_", "?")).rsplit(".", 1)[-1]
    model = f"{family} {cfg.model.config.get('name', '')}".strip() if cfg.model.get("config") else family
    described = recipe_description(RECIPES / f"{name}.yaml")
    return f"recipe {name}: {described}\nthis run: {mode_line(cfg.strategy.mode, sync_steps_of(cfg))}, model={model}"


def _log_lightning_to_file() -> None:
    """Lightning's own messages into the run's log too: its loggers keep a console handler of their own and do not
    propagate to the root logger, where Hydra put the log file."""
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    for name in ("lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        for handler in files:
            if handler not in logger.handlers:
                logger.addHandler(handler)


def run_summary(trainer) -> dict:
    """The run's last metrics for ``summary.json``: losses, rates, memory and the overall sparsity at the top;
    the per-layer densities grouped under ``sparsity_per_layer`` (``{"density": {layer: ...}, "target": ...}``)."""
    summary: dict = {"global_step": trainer.global_step}
    per_layer: dict = {}
    for key, value in sorted(trainer.callback_metrics.items()):
        parts = key.split("/", 2)
        if len(parts) == 3 and parts[0] == "sparsity":
            per_layer.setdefault(parts[1], {})[parts[2]] = float(value)
        else:
            summary[key] = float(value)
    if per_layer:
        summary["sparsity_per_layer"] = per_layer
    return summary


def end_table(summary: dict) -> str:
    """The end of a run, for a person: losses, rates, memory per stage, sparsity."""
    rows = [
        ("train_loss", "train loss", "{:.4f}"),
        ("val_loss", "val loss", "{:.4f}"),
        ("val_ppl", "val perplexity", "{:.2f}"),
        ("tokens_per_sec", "tokens/s", "{:,.0f}"),
        ("samples_per_sec", "samples/s", "{:,.1f}"),
        ("mfu", "MFU", "{:.1%}"),
        ("sparsity/density", "density", "{:.3f}"),
        ("sparsity/flops_ratio", "FLOPs vs dense", "{:.2f}"),
    ]
    lines = [f"run finished at step {summary['global_step']}"]
    lines += [f"  {label:<16}{text.format(summary[key])}" for key, label, text in rows if key in summary]
    memory = [f"{summary[k]:.2f}" for k in sorted(summary) if k.startswith("memory/")]
    if memory:
        lines.append(f"  {'memory GiB':<16}{' '.join(memory)} (per stage, peak)")
    return "\n".join(lines)


def _finish_wandb(logger) -> None:
    """Close the wandb run (writes its config and summary files) and say how to upload an offline run."""
    if type(logger).__name__ != "WandbLogger":
        return
    run_dir = Path(logger.experiment.dir).parent
    logger.experiment.finish()
    if logger._offline:
        say(f"wandb offline run: upload with `wandb sync {run_dir}`")


def main() -> None:
    import hydra

    from .usage import usage, wants_help

    if wants_help(sys.argv[1:]):
        print(usage("pd2bw-train", CONF, recipe_names()))
        return
    setup_hydra()
    sys.argv = [sys.argv[0], *_select_recipe(sys.argv[1:])]
    hydra.main(version_base="1.3", config_path=str(RECIPES), config_name="tiny")(_main)()


def _main(cfg) -> None:
    from ..engine.comm.grid import end_default_group

    try:
        run(cfg)
    except BaseException as error:
        logged(error, "pd2bw-train")
        refused(error, "pd2bw-train")
        raise
    finally:
        end_default_group()


def logged(error: BaseException, program: str) -> None:
    """A failure of a rank past 0 that its watchdog published: rank 0 says it, last, on the terminal; this rank's
    message or traceback goes to its own log file (``resilience.Resilience.on_exception``), and it exits 1."""
    path = getattr(error, "pd2bw_log_file", None)
    if path is None:
        return
    from ..errors import refusal_in

    with open(path, "a") as log:
        refusal = refusal_in(error)
        print(f"{program}: {refusal}" if refusal is not None else "", file=log)
        if refusal is None:
            traceback.print_exception(error, file=log)
    raise SystemExit(1) from None


def refused(error: BaseException, program: str) -> None:
    """End with a refusal's message alone (``errors.Refusal``, found through Lightning's and DCP's wrappers): no
    traceback, no Hydra hint. Anything else, or ``HYDRA_FULL_ERROR=1``, returns (the caller re-raises: a trace)."""
    from ..errors import refusal_in
    from .checks import ConfigError

    refusal = refusal_in(error)
    if refusal is None or os.environ.get("HYDRA_FULL_ERROR") == "1":
        return
    if getattr(refusal, "agreed", False) and _rank() != 0:  # every rank raised it alike: rank 0 says it once
        raise SystemExit(1) from None
    what = "bad configuration: " if isinstance(refusal, ConfigError) else ""
    message = refusal.strerror if isinstance(refusal, OSError) and refusal.strerror else str(refusal)  # no [Errno 28]
    raise SystemExit(f"{program}: {what}{message}") from None


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))


if __name__ == "__main__":
    main()
