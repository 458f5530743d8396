"""Structured-config schemas behind the Hydra groups, and the cross-field checks of a whole run.

Each group's YAML files start from a schema stored here (``defaults: [<group>_schema, _self_]``), so
a misspelt key or a value of the wrong type in a recipe or on the command line fails when Hydra
composes, naming the key. ``check_run`` then validates what no single group can (layers vs stages,
global vs micro batch, m >= d, world size vs width x depth) before any process or process group
exists, and derives the batch layout that the run and the dry run print.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any

from omegaconf import MISSING

from ..engine import layout as rules
from ..engine.options import PipelineOptions


def defaults_of(cls: Any) -> dict[str, Any]:
    """The defaults of ``cls``'s constructor: the schemas below take theirs from the classes they configure, so a
    default lives in one place (the class) and the YAML presets choose the recipes' values."""
    import inspect

    parameters = inspect.signature(cls.__init__).parameters.values()
    return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}


def _classes() -> tuple[dict[str, Any], ...]:
    from ..data.datamodule import TextDataModule
    from ..data.tokens import TokenDataModule
    from ..models.base import PipelineLanguageModel

    return tuple(map(defaults_of, (PipelineLanguageModel, TextDataModule, TokenDataModule)))


_MODEL, _DATA, _TOKENS = _classes()


@dataclass
class PresetSchema:
    _target_: str = MISSING
    name: str = MISSING
    n_layer: int | None = None  # overrides of the preset; null keeps the preset's value
    n_head: int | None = None
    n_embd: int | None = None
    block_size: int | None = None
    vocab_size: int | None = None
    seed: int | None = None


@dataclass
class ModelSchema:
    _target_: str = MISSING
    config: PresetSchema = field(default_factory=PresetSchema)
    optimizer: str = _MODEL["optimizer"]  # adamw | sgd | muon (Muon for the blocks' matrices + AdamW for the rest)
    lr: float = _MODEL["lr"]
    weight_decay: float = _MODEL["weight_decay"]
    betas: list[float] = field(default_factory=lambda: list(_MODEL["betas"]))
    momentum: float = _MODEL["momentum"]
    warmup_steps: int = _MODEL["warmup_steps"]
    max_steps: int | None = _MODEL["max_steps"]
    min_lr_ratio: float = _MODEL["min_lr_ratio"]


@dataclass
class DataSchema:
    _target_: str = "lightning_pd2bw.data.TextDataModule"
    task: str = _DATA["task"]
    seq_len: int = _DATA["seq_len"]
    batch_size: int | None = None  # per replica; derived from global_batch_size / data-parallel width
    paths: list[str] | None = None
    val_fraction: float = _DATA["val_fraction"]
    max_bytes: int | None = _DATA["max_bytes"]
    shuffle: bool = _DATA["shuffle"]
    seed: int = _DATA["seed"]
    num_workers: int = _DATA["num_workers"]
    hf_dataset: str | None = None  # a local Hugging Face dataset directory (never downloaded)
    hf_split: str = _DATA["hf_split"]
    text_column: str = _DATA["text_column"]
    tokenizer: str | None = None  # a local tokenizer.json (or its directory); null: bytes


@dataclass
class TokensDataSchema:
    _target_: str = "lightning_pd2bw.data.tokens.TokenDataModule"
    path: str = "data/tokens"  # a directory written by pd2bw-prepare-data
    seq_len: int = _TOKENS["seq_len"]
    batch_size: int | None = None  # per replica; derived from global_batch_size / data-parallel width
    shuffle: bool = _TOKENS["shuffle"]
    seed: int = _TOKENS["seed"]
    num_workers: int = _TOKENS["num_workers"]


# how a YAML value spells the options whose Python type OmegaConf cannot hold (a dtype, a tuple, anything)
STRATEGY_YAML_TYPES: dict[str, Any] = {
    "boundary_dtype": str | None,  # auto | null | bfloat16 | float16 | float32
    "layers_per_stage": list[int] | None,  # null: the planner's time-balanced cut (pd2bw-train)
    "compile": Any,  # true | {backend: ..., mode: ..., fullgraph: ...}
}


def strategy_schema() -> type:
    """``strategy.*``: generated from ``PipelineOptions``' fields (names, types, defaults; each documented there),
    so an option is declared once, in the options, and the strategy's signature (a unit test keeps that equal)."""
    import typing

    hints = typing.get_type_hints(PipelineOptions)
    fields: list[Any] = [("_target_", str, field(default="lightning_pd2bw.PipeDream2BWStrategy"))]
    for option in dataclasses.fields(PipelineOptions):
        if option.name != "keys":
            kind = STRATEGY_YAML_TYPES.get(option.name, hints[option.name])
            fields.append((option.name, kind, field(default=option.default)))
    return dataclasses.make_dataclass("StrategySchema", fields)


StrategySchema = strategy_schema()


@dataclass
class TrainerSchema:
    _target_: str = "lightning.pytorch.Trainer"
    accelerator: str = "auto"
    devices: Any = 2
    num_nodes: int = 1
    max_steps: int = -1
    max_epochs: int | None = None
    precision: str = "32-true"
    gradient_clip_val: float | None = None
    val_check_interval: Any = None
    check_val_every_n_epoch: int | None = 1
    limit_val_batches: Any = None
    limit_train_batches: Any = None
    log_every_n_steps: int = 50
    enable_checkpointing: bool = True
    enable_progress_bar: bool = True
    enable_model_summary: bool = False
    accumulate_grad_batches: int = 1
    default_root_dir: str | None = None


@dataclass
class SparsityCommon:
    _target_: str = MISSING
    sparsity: float = 0.75
    allocation: str = "uniform"
    targets: list[str] | None = None
    min_layer_density: float = 0.01
    dense_from_step: int | None = None
    rewarmup_steps: int = 0
    seed: int = 0
    log_per_layer: bool = True


@dataclass
class GradualSchema(SparsityCommon):
    end_step: int = MISSING
    start_step: int = 0
    update_interval: int = 100
    initial_sparsity: float = 0.0
    shape: str = "cubic"


@dataclass
class StaticSchema(SparsityCommon):
    init: str = "random"


@dataclass
class RigLSchema(SparsityCommon):
    end_step: int = MISSING
    update_interval: int = 100
    drop_fraction: float = 0.3
    init: str = "random"


@dataclass
class CSVLoggerSchema:
    _target_: str = "lightning.pytorch.loggers.CSVLogger"
    save_dir: str = MISSING
    name: str = "csv"


@dataclass
class WandbLoggerSchema:
    _target_: str = "lightning.pytorch.loggers.WandbLogger"
    project: str = "lightning_pd2bw"
    name: str | None = None
    save_dir: str = MISSING
    offline: bool = True
    log_model: bool = False


@dataclass
class ClusterSchema:
    """A cluster for ``pd2bw-plan`` (conf/cluster/*.yaml): servers of devices and their links."""

    name: str = MISSING
    device: str = MISSING  # a key of lightning_pd2bw.planner.hardware.DEVICES
    num_nodes: int = 1
    devices_per_node: int = 8
    intra_node_bandwidth: float = MISSING  # bytes/s between two devices of one server
    inter_node_bandwidth: float = MISSING  # bytes/s out of one server
    latency: float = 2e-5  # seconds per message


SCHEMAS = {
    ("model", "model_schema"): ModelSchema,
    ("data", "data_schema"): DataSchema,
    ("data", "tokens_schema"): TokensDataSchema,
    ("strategy", "strategy_schema"): StrategySchema,
    ("trainer", "trainer_schema"): TrainerSchema,
    ("sparsity", "gradual_schema"): GradualSchema,
    ("sparsity", "static_schema"): StaticSchema,
    ("sparsity", "rigl_schema"): RigLSchema,
    ("logger", "csv_schema"): CSVLoggerSchema,
    ("logger", "wandb_schema"): WandbLoggerSchema,
    ("cluster", "cluster_schema"): ClusterSchema,
}


def register_schemas() -> None:
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for (group, name), node in SCHEMAS.items():
        store.store(group=group, name=name, node=node)


# ---------------------------------------------------------------------------------------------- checks
@dataclass(frozen=True)
class RunLayout:
    world_size: int
    num_stages: int
    data_parallel_size: int
    global_batch_size: int
    micro_batch_size: int
    batch_per_replica: int
    num_microbatches: int
    seq_len: int

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the keys and the fix."""


def world_size_of(trainer_cfg: Any) -> int:
    devices, nodes = trainer_cfg.devices, trainer_cfg.num_nodes
    if isinstance(devices, int) and devices > 0:
        return devices * nodes
    if isinstance(devices, (list, tuple)) or type(devices).__name__ == "ListConfig":
        return len(devices) * nodes
    import torch

    count = torch.cuda.device_count() if trainer_cfg.accelerator in ("auto", "gpu", "cuda") else 0
    if count == 0:
        raise ConfigError(
            f"trainer.devices={devices!r} with no GPU: set trainer.devices to the number of CPU processes (e.g. 2)"
        )
    return count * nodes


def context_of(model_cfg: Any) -> int:
    from hydra.utils import instantiate

    return instantiate(model_cfg.config).block_size


def vocab_of(model_cfg: Any) -> int:
    from hydra.utils import instantiate

    return instantiate(model_cfg.config).vocab_size


def check_run(cfg: Any, num_layers: int | None = None) -> RunLayout:
    """Cross-field checks; returns the batch layout. ``num_layers`` (pipeline layers) when known."""
    world = world_size_of(cfg.trainer)
    check_options(cfg.strategy)
    if cfg.strategy.get("plan") == "auto":
        return _check_auto(cfg, world)
    depth = cfg.strategy.num_stages or world
    width = _layout_rule(rules.width_of, world, depth)
    global_batch, micro = cfg.global_batch_size, cfg.micro_batch_size
    if global_batch % width:
        raise ConfigError(
            f"global_batch_size={global_batch} is not divisible by the data-parallel width {width} "
            f"(= {world} processes / {depth} stages); use a multiple of {width}"
        )
    per_replica = global_batch // width
    if per_replica % micro:
        raise ConfigError(
            f"global_batch_size={global_batch} / width {width} = {per_replica} sequences per replica is not a multiple "
            f"of micro_batch_size={micro}; choose global_batch_size as a multiple of {micro * width}"
        )
    microbatches = per_replica // micro
    if cfg.strategy.num_microbatches not in (None, microbatches):
        raise ConfigError(
            f"strategy.num_microbatches={cfg.strategy.num_microbatches} contradicts global_batch_size={global_batch} "
            f"/ (width {width} x micro_batch_size={micro}) = {microbatches}; leave strategy.num_microbatches=null"
        )
    keys = replace(
        CONFIG_KEYS,
        more_microbatches=f"raise global_batch_size to >= {depth * micro * width}, lower micro_batch_size, or use "
        "fewer strategy.num_stages",
    )
    _layout_rule(rules.check_schedule, cfg.strategy.mode, depth, microbatches, keys=keys)
    _layout_rule(rules.check_pipeline, cfg.strategy.mode, depth, world, keys=keys)
    _layout_rule(rules.check_lookahead, cfg.strategy.mode, cfg.strategy.get("lookahead", 0), keys=keys)
    if num_layers is not None:
        _layout_rule(rules.check_layers, num_layers, depth)
    _check_data(cfg)
    check_checkpoint(cfg.get("ckpt_path"), num_layers)
    return RunLayout(world, depth, width, global_batch, micro, per_replica, microbatches, cfg.data.seq_len)


def check_options(strategy: Any) -> PipelineOptions:
    """Every ``strategy.*`` option, by the strategy's own rules (``PipelineOptions``), before any process starts."""
    from omegaconf import OmegaConf

    values = OmegaConf.to_container(strategy, resolve=True) if OmegaConf.is_config(strategy) else dict(strategy)
    try:
        return PipelineOptions.from_mapping(values, CONFIG_KEYS)
    except ValueError as error:
        raise ConfigError(str(error)) from None


CONFIG_KEYS = rules.Keys(
    prefix="strategy.",
    num_stages="strategy.num_stages",
    num_microbatches="global_batch_size / (width x micro_batch_size)",
    mode="strategy.mode",
    layers_per_stage="strategy.layers_per_stage",
    lookahead="strategy.lookahead",
    world="trainer.devices x trainer.num_nodes",
)


def _layout_rule(rule: Any, *args: Any, keys: rules.Keys = CONFIG_KEYS) -> Any:
    """A layout rule of ``engine/layout.py`` in the config's keys, raised as a ``ConfigError``."""
    try:
        return rule(*args, keys)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def check_checkpoint(path: Any, num_layers: int | None) -> None:
    """``ckpt_path`` names a complete pd2bw checkpoint of this model (any depth x width: it is resharded)."""
    if not path:
        return
    from ..checkpoint.store import read_manifest

    try:
        manifest = read_manifest(path)
    except (FileNotFoundError, ValueError) as error:
        raise ConfigError(f"ckpt_path={path}: {error}") from None
    if num_layers is not None and manifest["num_layers"] != num_layers:
        raise ConfigError(
            f"ckpt_path={path} was written for a model with {manifest['num_layers']} pipeline layers; model.* "
            f"here builds {num_layers}. Use the checkpoint's model settings (its run directory's config.yaml)"
        )


def _check_auto(cfg: Any, world: int) -> RunLayout:
    """``strategy.plan=auto``: the planner picks depth and microbatches at start-up; only the global batch is
    fixed. Each process's loader starts at global / world samples and the strategy re-batches it."""
    if cfg.global_batch_size % world:
        raise ConfigError(
            f"global_batch_size={cfg.global_batch_size} with strategy.plan=auto must be a multiple of the world size "
            f"{world} so that every layout the planner considers splits it evenly"
        )
    _check_data(cfg)
    per_device = cfg.global_batch_size // world
    return RunLayout(world, 0, 0, cfg.global_batch_size, 0, per_device, 0, cfg.data.seq_len)


def check_tokens(cfg: Any) -> None:
    """``data=tokens`` before a real run (a dry run needs no data): the corpus is there and fits the model."""
    if not str(cfg.data.get("_target_", "")).endswith("TokenDataModule"):
        return
    from ..data.tokens import read_index

    try:
        vocab = read_index(cfg.data.path)["vocab_size"]
    except FileNotFoundError as error:
        raise ConfigError(str(error)) from None
    if vocab > vocab_of(cfg.model):
        raise ConfigError(
            f"data.path={cfg.data.path!r} holds a vocabulary of {vocab} tokens but the model's is "
            f"{vocab_of(cfg.model)}; set model.config.vocab_size={-(-vocab // 64) * 64}"
        )


def _check_data(cfg: Any) -> None:
    block = context_of(cfg.model)
    if cfg.data.seq_len > block:
        raise ConfigError(
            f"data.seq_len={cfg.data.seq_len} exceeds the model's context model.config.block_size={block}; lower "
            "data.seq_len or raise the block size"
        )
    if cfg.data.get("tokenizer"):
        from ..data.hf import load_tokenizer

        vocab, model_vocab = load_tokenizer(cfg.data.tokenizer).get_vocab_size(), vocab_of(cfg.model)
        if vocab > model_vocab:
            raise ConfigError(
                f"data.tokenizer has {vocab} tokens but the model's vocabulary is {model_vocab}; set "
                f"model.config.vocab_size={-(-vocab // 64) * 64}"
            )
    if cfg.trainer.accumulate_grad_batches != 1:
        raise ConfigError(
            "trainer.accumulate_grad_batches must be 1 with strategy=pd2bw: the pipeline accumulates over its "
            "microbatches; raise global_batch_size instead"
        )
