"""Structured-config schemas behind the Hydra groups.

Each group's YAML files start from a schema stored here (``defaults: [<group>_schema, _self_]``), so
a misspelt key or a value of the wrong type in a recipe or on the command line fails when Hydra
composes, naming the key. The strategy's schema is generated from ``PipelineOptions`` and ``StrategyOptions``; the
others take their
defaults from the classes they configure. What no single group can check is ``checks.py``'s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from ..engine.options import PipelineOptions
from ..lightning.options import StrategyOptions


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
    gelu: str | None = None  # exact | tanh (GPT-2's checkpoints: init_from a Hugging Face GPT-2 directory)


@dataclass
class ModelSchema:
    _target_: str = MISSING
    config: PresetSchema = field(default_factory=PresetSchema)
    # adamw | nadamw | sgd | muon (Muon for the blocks' matrices + AdamW for the rest)
    optimizer: str = _MODEL["optimizer"]
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
    allow_changed: bool = False  # resume on files other than the checkpoint's (the data position restarts)


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
    "weight_dtype": str | None,  # auto | null | bfloat16
    "grad_reduce_dtype": str | None,  # null (the gradients' own) | float32 | bfloat16
    "layers_per_stage": list[int] | None,  # null: the planner's time-balanced cut (pd2bw-train)
    "recompute": Any,  # true | false | [n0, n1, ...]: per stage, its first layers recomputed
    "compile": Any,  # true | {backend: ..., mode: ..., fullgraph: ...}
}


def strategy_schema() -> type:
    """``strategy.*``: generated from the fields of ``PipelineOptions`` (the engine's) and ``StrategyOptions`` (the
    Lightning strategy's own), names, types and defaults, each documented there, so an option is declared once and
    the strategy's signature stays the flat union users type (a unit test keeps them equal). ``clipping`` is typed
    as its ``clip_mode`` (the value and the algorithm are the Trainer's)."""
    import typing

    fields: list[Any] = [("_target_", str, field(default="lightning_pd2bw.PipeDream2BWStrategy"))]
    for options in (PipelineOptions, StrategyOptions):
        hints = typing.get_type_hints(options)
        for option in dataclasses.fields(options):
            if option.name == "keys":
                continue
            if option.name == "clipping":
                fields.append(("clip_mode", str, field(default=option.default.mode)))
                continue
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
    dense_lr: float | None = None  # with dense_from_step: the dense phase's own peak rate (x the schedule's peak)
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
    density_scaling: bool = False  # SμPar: init x 1/sqrt(density), Adam's rate x 1/density per layer


@dataclass
class RigLSchema(SparsityCommon):
    end_step: int = MISSING
    update_interval: int = 100
    drop_fraction: float = 0.3
    init: str = "random"
    density_scaling: bool = False  # SμPar: init x 1/sqrt(density), Adam's rate x 1/density per layer


@dataclass
class SemiStructuredSchema:
    """N:M semi-structured sparsity (``SemiStructuredSparsity``): its sparsity is 1 - n/m, not a key of its own."""

    _target_: str = MISSING
    n: int = 2
    m: int = 4
    sparsity: float | None = None  # 1 - n/m; a recipe's value (tiny's 0.5) must agree
    transposable: bool | None = None  # n of m in each row and column of every m x m tile (null: as kernels)
    kernels: bool = False  # CUDA: the final 2:4 mask's forward and input-gradient GEMMs on sparse tensor cores
    start_step: int = 0
    end_step: int = 0
    update_interval: int = 100
    allocation: str = "uniform"
    targets: list[str] | None = None
    dense_from_step: int | None = None
    rewarmup_steps: int = 0
    dense_lr: float | None = None
    seed: int = 0
    log_per_layer: bool = True


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
    ("sparsity", "semi_structured_schema"): SemiStructuredSchema,
    ("logger", "csv_schema"): CSVLoggerSchema,
    ("logger", "wandb_schema"): WandbLoggerSchema,
    ("cluster", "cluster_schema"): ClusterSchema,
}


def register_schemas() -> None:
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for (group, name), node in SCHEMAS.items():
        store.store(group=group, name=name, node=node)
