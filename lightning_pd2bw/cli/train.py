"""Hydra entry point: ``pd2bw-train [recipe=NAME] [overrides...]`` (also ``python -m lightning_pd2bw.train``).

``recipe=NAME`` selects ``recipes/NAME.yaml`` (default: ``tiny``), a whole experiment built on
``conf/config.yaml``. The configuration is checked (``config.check_run``) before any process starts;
``dry_run=true`` prints the plan (stages, parameters, batch layout, memory) from the meta device and
stops. Lightning's launcher re-runs this command in each rank with ``hydra.run.dir`` pinned, so all
ranks share one output directory.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# an installed wheel carries the configurations in the package (setup.py); a source checkout has them at the top
_PACKAGED = Path(__file__).resolve().parents[1]
CONF = _PACKAGED / "conf" if (_PACKAGED / "conf" / "config.yaml").is_file() else ROOT / "conf"
RECIPES = _PACKAGED / "recipes" if (_PACKAGED / "recipes" / "tiny.yaml").is_file() else ROOT / "recipes"


def register_resolvers() -> None:
    """``${mul:a,b}`` (an int: steps from fractions of training) and ``${max:a,b}`` for the configs."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("mul"):
        OmegaConf.register_new_resolver("mul", lambda a, b: int(a * b))
    if not OmegaConf.has_resolver("max"):
        OmegaConf.register_new_resolver("max", lambda a, b: max(a, b))
    if not OmegaConf.has_resolver("pd2bw_run_name"):
        OmegaConf.register_new_resolver("pd2bw_run_name", run_name, use_cache=True)


def run_name() -> str:
    """The run's directory name: the same on every rank of a job and across its restarts, different for two jobs.

    ``PD2BW_RUN_ID`` (set it to share a directory on purpose) > torchrun's ``--rdzv-id`` (``--standalone``
    draws a fresh one) > ``SLURM_JOB_ID`` > the start time and pid of the process that started the ranks: under
    torchrun without ``--rdzv-id`` (its run id is then ``"none"`` for every job) the agent, which every local
    worker shares and which outlives restarts; otherwise this process (Lightning's launcher passes rank 0's
    directory to the ranks it starts).
    """
    if os.environ.get("PD2BW_RUN_ID"):
        return os.environ["PD2BW_RUN_ID"]
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        return run_id
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm-{os.environ['SLURM_JOB_ID']}"
    pid = os.getppid() if run_id == "none" else os.getpid()
    return f"{_start_time(pid):%Y-%m-%d_%H-%M-%S}-{pid}"


def _start_time(pid: int) -> datetime.datetime:
    """When process ``pid`` started (Linux ``/proc``; elsewhere: now)."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
        )
        return datetime.datetime.fromtimestamp(boot + ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, StopIteration):
        return datetime.datetime.now()


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
    """What matters at start-up (and all a dry run prints): stages, layers, parameters, batches, memory.

    Stages are cut as the planner cuts them (balanced by estimated time, not parameter count) and
    memory per stage comes from its cost model with the analytic transformer profile.
    """
    from ..lightning.strategy import pipeline_layers_of
    from ..planner.cost import stage_memory
    from ..planner.hardware import GiB

    layers = pipeline_layers_of(model)
    profile = analytic_model_profile(cfg, model, layout.micro_batch_size)
    candidate = candidate_of(cfg, layout)
    stages = planned_stages(cfg, layout, model)
    memories = [stage_memory(profile, span, s, candidate, layout.num_microbatches) for s, span in enumerate(stages)]
    total = sum(p.numel() for p in model.parameters())
    lines = [
        f"model: {type(model).__name__} {cfg.model.config.name}: {total:,} parameters ({total / 1e9:.2f}B), "
        f"{len(layers)} pipeline layers",
        f"layout: {layout.world_size} processes = {layout.num_stages} stages x {layout.data_parallel_size} replicas; "
        f"mode={cfg.strategy.mode}{_lookahead(cfg)} recompute={cfg.strategy.recompute} precision={cfg.trainer.precision}",
        f"batch: global {layout.global_batch_size} = {layout.data_parallel_size} replicas x "
        f"{layout.num_microbatches} microbatches x {layout.micro_batch_size} sequences; "
        f"tokens per step = {layout.global_batch_size} x {layout.seq_len} = {layout.tokens_per_step:,}",
    ]
    lines.append(data_text(cfg))
    if (sparsity := sparsity_config(cfg)) is not None:
        lines.append(f"sparsity: {sparsity._target_.rsplit('.', 1)[-1]} to {sparsity.sparsity:.0%} of the targets")
    for stage, (span, memory) in enumerate(zip(stages, memories)):
        params = sum(profile.layers[i].parameters for i in span)
        terms = ", ".join(f"{name} {value / GiB:.2f}" for name, value in memory.items())
        lines.append(
            f"  stage {stage}: layers {span.start}..{span.stop - 1}, {params:,} parameters, est. memory "
            f"{sum(memory.values()) / GiB:.2f} GiB ({terms})"
        )
    lines += memory_warnings(cfg, memories)
    return "\n".join(lines)


def memory_warnings(cfg, memories: list[dict[str, float]]) -> list[str]:
    """A warning, with the fix, for each stage whose estimate exceeds what the cluster's device offers."""
    from ..engine.delay_correction import buffers as correction_buffers
    from ..planner.hardware import DEVICES, GiB
    from ..planner.search import MEMORY_HEADROOM

    if not cfg.get("cluster"):
        return []
    device = DEVICES[cfg.cluster.device]
    usable = device.memory_bytes * MEMORY_HEADROOM
    out = []
    for stage, memory in enumerate(memories):
        need = sum(memory.values())
        if need > usable:
            held = correction_buffers(cfg.strategy.get("delay_correction"))
            buffer = memory.get("correction", 0.0) / held if held else 0.0
            fixes = ["more stages (strategy.num_stages)"]
            fixes += [] if cfg.strategy.recompute else ["strategy.recompute=true"]
            fixes += ["a smaller micro_batch_size"] if cfg.get("micro_batch_size", 1) > 1 else []
            if held > 1:
                fixes.append(f"strategy.delay_correction=error_feedback (saves {buffer / GiB:.2f} GiB)")
            if held:  # its buffers and D(t) while updating
                fixes.append(f"strategy.delay_correction=null (saves {(held + 1) * buffer / GiB:.2f} GiB)")
            out.append(
                f"WARNING: stage {stage} needs an estimated {need / GiB:.2f} GiB, more than the {usable / GiB:.1f} GiB "
                f"usable on {device.name} ({MEMORY_HEADROOM:.0%} of {device.memory_bytes / GiB:.0f} GiB): it would "
                f"run out of memory. Fixes: {'; '.join(fixes)}"
            )
    return out


def data_text(cfg) -> str:
    """What the run reads, and for a tokenized corpus whether it is there and how to prepare it."""
    if not str(cfg.data.get("_target_", "")).endswith("TokenDataModule"):
        source = cfg.data.get("hf_dataset") or cfg.data.get("paths") or "the embedded corpus (bytes)"
        return f"data: {source}"
    from ..data.tokens import INDEX, read_index
    from .config import vocab_of

    path = cfg.data.path
    vocab = vocab_of(cfg.model)
    try:
        index = read_index(path)
    except FileNotFoundError:
        return (
            f"data: a tokenized corpus at data.path={path} (not there: no {INDEX}). Prepare it with: "
            f"pd2bw-prepare-data {path} YOUR_TEXT_FILES_OR_DIRS --vocab-size {vocab} (or --tokenizer tokenizer.json)"
        )
    return (
        f"data: {index['tokens']:,} tokens at {path} ({index['dtype']}, vocabulary {index['vocab_size']:,}; the "
        f"model's {vocab:,})"
    )


def _lookahead(cfg) -> str:
    """`` lookahead=N`` where it is set (the dry run's layout line)."""
    lookahead = cfg.strategy.get("lookahead", 0)
    return f" lookahead={lookahead}" if lookahead else ""


def candidate_of(cfg, layout):
    from ..planner import Candidate

    return Candidate(
        layout.data_parallel_size,
        layout.num_stages,
        layout.micro_batch_size,
        cfg.strategy.recompute,
        cfg.strategy.mode,
        cfg.strategy.get("lookahead", 0),
        cfg.strategy.get("delay_correction"),
    )


def planned_stages(cfg, layout, model) -> list[range]:
    """The stages pd2bw-train runs: ``strategy.layers_per_stage``, else the planner's cut balanced by time."""
    from ..engine.layout import ranges_of
    from ..planner.search import partition

    if cfg.strategy.get("layers_per_stage"):
        return ranges_of(list(cfg.strategy.layers_per_stage), len(model.pipeline_layers()))
    profile = analytic_model_profile(cfg, model, layout.micro_batch_size)
    return partition(profile, candidate_of(cfg, layout), layout.num_microbatches, float("inf"))


def analytic_model_profile(cfg, model, micro_batch_size: int):
    """The planner's analytic profile of the configured model at ``micro_batch_size`` (FLOPs and bytes)."""
    from hydra.utils import instantiate

    from ..engine.partition import layer_parameter_counts
    from ..lightning.strategy import pipeline_layers_of
    from ..planner.auto import shared_layers
    from ..planner.cost import NCCL_BYTES_PER_COMMUNICATOR, ModelProfile
    from ..planner.hardware import DEVICES
    from ..planner.profile import analytic_profile, bytes_per_element

    config = instantiate(cfg.model.config)
    layers = pipeline_layers_of(model)
    counts = layer_parameter_counts(layers)
    device = DEVICES[cfg.cluster.device] if cfg.get("cluster") else DEVICES["a100_80g"]
    weight_bytes = bytes_per_element(cfg.trainer.precision)[0]
    profiles = analytic_profile(
        num_blocks=len(layers) - 2,
        hidden=config.n_embd,
        heads=config.n_head,
        vocab=config.vocab_size,
        seq=cfg.data.seq_len,
        micro=micro_batch_size,
        device=device,
        precision=cfg.trainer.precision,
        embedding_parameters=counts[0],
        head_parameters=counts[-1],
    )
    states = 1 if cfg.model.optimizer == "sgd" else 2
    mixed = cfg.trainer.precision in ("bf16-mixed", "16-mixed")  # float32 outputs kept, 16-bit ones sent
    on_cpu = cfg.trainer.get("accelerator") == "cpu" and not cfg.get("cluster")
    return ModelProfile(
        profiles,
        weight_bytes,
        states,
        shared_layers(layers),
        output_factor=2.0 if mixed else 1.0,
        communicator_bytes=0.0 if on_cpu else NCCL_BYTES_PER_COMMUNICATOR,
    )


def run(cfg) -> dict:
    import lightning.pytorch as pl
    import torch
    from hydra.utils import instantiate
    from lightning.pytorch.callbacks import ModelCheckpoint
    from omegaconf import OmegaConf

    import lightning_pd2bw  # noqa: F401  (registers the strategy)

    from ..lightning.callbacks import RunMetrics
    from .config import check_run, check_tokens

    _pin_output_dir(cfg)
    _resolve_last_checkpoint(cfg)
    layout = check_run(cfg)  # before any process or process group exists
    auto = cfg.strategy.get("plan") == "auto"
    if cfg.dry_run and auto:
        print(
            "dry run: strategy.plan=auto chooses the layout at start-up from profiles of this machine; preview "
            "plans for a cluster with `pd2bw-plan recipe=NAME cluster=NAME`"
        )
        return {"dry_run": True}
    if cfg.dry_run:
        model = build_model_on_meta(cfg)
        check_run(cfg, num_layers=len(model.pipeline_layers()))
        text = plan_text(cfg, layout, model)
        print(f"dry run (nothing allocated, no process started)\n{text}")
        return {"dry_run": True}
    check_tokens(cfg)
    torch.set_num_threads(max(1, torch.get_num_threads() // max(1, layout.world_size // cfg.trainer.num_nodes)))
    pl.seed_everything(cfg.seed, workers=True)
    model = instantiate(cfg.model)
    data = instantiate(cfg.data, batch_size=layout.batch_per_replica)
    if auto:
        strategy = instantiate(cfg.strategy, global_batch_size=layout.global_batch_size)
    else:
        cut = cfg.strategy.get("layers_per_stage") or [
            len(r) for r in planned_stages(cfg, layout, build_model_on_meta(cfg))
        ]
        strategy = instantiate(
            cfg.strategy, num_stages=layout.num_stages, num_microbatches=layout.num_microbatches, layers_per_stage=cut
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
    trainer = instantiate(cfg.trainer, strategy=strategy, logger=logger, callbacks=callbacks)
    out = Path(cfg.paths.output_dir)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    if sparsity is None:  # sparsity=none: a recipe's leftover keys (tiny's sparsity.sparsity) would read as sparse
        resolved["sparsity"] = None
    if trainer.is_global_zero:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
        if not auto:
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


def _resolve_last_checkpoint(cfg) -> None:
    """``ckpt_path=last``: the newest complete checkpoint the run's checkpoint callback wrote (a run restarted by
    ``torchrun --max-restarts`` resumes from it: its ranks and restarts share the run directory), or a fresh
    start when there is none yet."""
    from omegaconf import open_dict

    from ..checkpoint.store import newest_checkpoint

    if cfg.get("ckpt_path") != "last":
        return
    node = (cfg.get("callbacks") or {}).get("model_checkpoint")
    directory = Path(node.dirpath) if node and node.get("dirpath") else Path(cfg.paths.output_dir) / "checkpoints"
    found = newest_checkpoint(directory)
    print(f"ckpt_path=last: {f'resuming from {found}' if found else f'no checkpoint in {directory} yet, starting'}")
    with open_dict(cfg):
        cfg.ckpt_path = str(found) if found else None


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
