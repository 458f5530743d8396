"""The cross-field checks of a whole run, before any process or process group exists.

``check_run`` validates what no single group's schema can (layers vs stages, global vs micro batch, m >= d, world
size vs width x depth, batch and sequence sizes, the learning rate, the steps, the precision, the data files) and
derives the batch layout that the run and the dry run print. Each error names the key and the fix (``ConfigError``).
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..engine import layout as rules
from ..engine.options import PipelineOptions, Run
from ..engine.precision import SUPPORTED, Precision
from ..errors import Refusal
from ..lightning.options import StrategyOptions


@dataclass(frozen=True)
class RunLayout:
    """The batch layout of a ``pd2bw-train`` run, and its ``Run`` (None under ``strategy.plan=auto``, whose layout the
    planner chooses at start-up)."""

    world_size: int
    num_stages: int
    data_parallel_size: int
    global_batch_size: int
    micro_batch_size: int
    batch_per_replica: int
    num_microbatches: int
    seq_len: int
    run: Run | None = None

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len


class ConfigError(Refusal, ValueError):
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
    options = check_options(cfg.strategy)
    check_values(cfg)
    if cfg.strategy.get("plan") == "auto":
        return _check_auto(cfg, world)
    precision = str(cfg.trainer.precision)
    width = _resolved(options, world, precision).width  # the depth's own checks, m not known yet
    depth = world // width
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
    if options.num_microbatches not in (None, microbatches):
        raise ConfigError(
            f"strategy.num_microbatches={options.num_microbatches} contradicts global_batch_size={global_batch} "
            f"/ (width {width} x micro_batch_size={micro}) = {microbatches}; leave strategy.num_microbatches=null"
        )
    keys = replace(
        CONFIG_KEYS,
        more_microbatches=f"raise global_batch_size to >= {depth * micro * width}, lower micro_batch_size, or use "
        "fewer strategy.num_stages",
    )
    run = _resolved(options, world, precision, num_microbatches=microbatches, keys=keys)
    if num_layers is not None:
        _layout_rule(rules.check_layers, num_layers, depth)
        if cfg.strategy.get("layers_per_stage"):
            _layout_rule(rules.ranges_of, list(cfg.strategy.layers_per_stage), num_layers)
    _check_data(cfg)
    check_checkpoint(cfg.get("ckpt_path"), num_layers)
    if (start := cfg.get("init_from")) and not Path(str(start)).exists():
        raise ConfigError(
            f"init_from={start}: no such file or directory; give a pd2bw checkpoint directory, a consolidated file "
            "(pd2bw-consolidate) or a Hugging Face model directory"
        )
    return RunLayout(world, depth, width, global_batch, micro, per_replica, microbatches, cfg.data.seq_len, run)


def _resolved(options: PipelineOptions, world: int, precision: str, **changes: Any) -> Run:
    """``options.resolve`` on the run's world and precision, its refusals raised as ``ConfigError``."""
    try:
        return options.replace(**changes).resolve(world, precision)
    except ValueError as error:
        raise ConfigError(str(error)) from None


def check_values(cfg: Any) -> None:
    """Single values no schema type can refuse: sizes, the learning rate, the steps, the precision; and the keys a
    recipe ``requires`` (``recipe=prune``: ``init_from``)."""
    for key in cfg.get("requires") or []:
        if cfg.get(key) in (None, ""):
            raise ConfigError(
                f"{key} is required by this recipe (requires: {list(cfg.requires)}): add {key}=..."
                + (
                    " (the trained weights it starts from: a pd2bw checkpoint directory, a consolidated file from "
                    "pd2bw-consolidate, or a Hugging Face model directory)"
                    if key == "init_from"
                    else ""
                )
            )
    positive = {
        "global_batch_size": cfg.get("global_batch_size"),
        "micro_batch_size": cfg.get("micro_batch_size"),
        "data.seq_len": cfg.data.get("seq_len"),
        "model.lr": cfg.model.get("lr"),
    }
    for key, value in positive.items():
        if value is not None and not value > 0:
            raise ConfigError(f"{key}={value} must be > 0")
    if (decay := cfg.model.get("weight_decay")) is not None and decay < 0:
        raise ConfigError(f"model.weight_decay={decay} must be >= 0 (0: no decay)")
    steps = cfg.trainer.get("max_steps")
    if steps is not None and steps != -1 and steps < 1:
        raise ConfigError(f"trainer.max_steps={steps} must be >= 1 (or -1: as many as trainer.max_epochs give)")
    precision = str(cfg.trainer.get("precision", "32-true"))
    if not Precision.of(precision).supported:
        raise ConfigError(
            f"trainer.precision={precision!r} is not supported with strategy=pd2bw; supported: "
            f"{', '.join(SUPPORTED)} (bf16-mixed: bfloat16 compute, float32 weights; 16-mixed needs one loss scale "
            "over all stages, 16-true/bf16-true would hold both weight versions in half precision)"
        )


def check_text_files(paths: Any) -> None:
    """``data.paths``: each file is there, not empty and text: UTF-8 without NUL bytes over every byte (streamed at
    disk speed; a progress bar where it takes more than a moment, on a terminal)."""
    for path in paths or []:
        file = Path(path)
        if not file.is_file():
            raise ConfigError(f"data.paths: {path!r} is not a file; give existing UTF-8 text files")
        if not file.open("rb").read(1 << 16).strip():
            raise ConfigError(f"data.paths: {path!r} is empty; give a text file with training data")
        try:
            _check_utf8(file)
        except UnicodeDecodeError as error:
            raise ConfigError(
                f"data.paths: {path!r} is not UTF-8 text ({error.reason} at byte {error.start:,}); the byte-level "
                "GPT reads text files: convert it, or tokenize it with pd2bw-prepare-data and use data=tokens"
            ) from None


TEXT_CHUNK = 4 << 20
PROGRESS_FROM_BYTES = 256 << 20  # about a second of checking: larger files show a progress bar


def _check_utf8(file: Path) -> None:
    """Every byte of ``file`` decodes as UTF-8 and none is NUL; the error's ``start`` is the offending byte's offset
    in the file."""
    from tqdm import tqdm

    size = file.stat().st_size
    decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
    with (
        open(file, "rb") as handle,
        tqdm(
            total=size,
            unit="B",
            unit_scale=True,
            desc=f"checking {file.name}",
            disable=size < PROGRESS_FROM_BYTES or None,
        ) as bar,
    ):
        while chunk := handle.read(TEXT_CHUNK):
            at = chunk.find(b"\0")
            try:
                if at >= 0:
                    raise UnicodeDecodeError("utf-8", chunk, at, at + 1, "a NUL byte")
                decoder.decode(chunk, final=False)
            except UnicodeDecodeError as error:
                raise UnicodeDecodeError(
                    "utf-8", chunk, offset + error.start, offset + error.end, error.reason
                ) from None
            offset += len(chunk)
            bar.update(len(chunk))
        decoder.decode(b"", final=True)


def check_options(strategy: Any) -> PipelineOptions:
    """Every ``strategy.*`` option, by the strategy's own rules (``PipelineOptions`` and ``StrategyOptions``), before
    any process starts; returns the pipeline's."""
    from omegaconf import OmegaConf

    values = OmegaConf.to_container(strategy, resolve=True) if OmegaConf.is_config(strategy) else dict(strategy)
    try:
        own = StrategyOptions.from_mapping(values, CONFIG_KEYS)
        pipeline = PipelineOptions.from_mapping(values, CONFIG_KEYS)
        own.check(pipeline)
        return pipeline
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
    from ..checkpoint.store import read_manifest, read_meta

    try:
        manifest = read_manifest(path)
        read_meta(path)  # Lightning's part, by the safe unpickler: a crafted file is refused here, before launch
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
    check_text_files(cfg.data.get("paths"))
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
