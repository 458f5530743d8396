"""``pd2bw-train --help`` and ``pd2bw-plan --help``: what users type (recipes, each group's options, the keys most
runs set), read from the configuration folders themselves, instead of Hydra's list of schema names."""

from __future__ import annotations

from pathlib import Path

from ..engine.layout import MODES

GROUPS = ("model", "data", "strategy", "trainer", "sparsity", "logger", "callbacks")
KEYS = (
    ("global_batch_size=N micro_batch_size=N", "the batch: m = global / (replicas x micro) microbatches"),
    ("trainer.devices=N trainer.num_nodes=N", "processes (GPUs, or CPU processes)"),
    (f"strategy.num_stages=D strategy.mode={'|'.join(MODES)}", "pipeline depth and schedule"),
    ("trainer.max_steps=N model.lr=X", "length and learning rate"),
    ("data.paths=[a.txt,b.txt] | data=tokens data.path=DIR", "your text, or a prepared token corpus"),
    ("ckpt_path=last|PATH", "resume"),
    ("dry_run=true", "print the plan (stages, memory, batch) and stop: no GPU, no data needed"),
)


def options(conf: Path, group: str) -> list[str]:
    return sorted(p.stem for p in (conf / group).glob("*.yaml"))


def usage(program: str, conf: Path, recipes: list[str], clusters: list[str] | None = None) -> str:
    planning = clusters is not None
    lines = [
        f"usage: {program} [recipe=NAME]"
        + (" cluster=NAME" if planning else "")
        + " [group=option ...] [key=value ...]",
        "",
        "Pipeline-parallel training (PipeDream-2BW) for Lightning, configured by Hydra."
        if not planning
        else "The planner: the fastest width x depth x microbatch x recomputation that fits the cluster (no GPU).",
        "",
        "recipes (recipe=NAME; default tiny):",
        *[f"  {name:<14} {recipe_description(conf.parent / 'recipes' / f'{name}.yaml')}" for name in recipes],
    ]
    if planning:
        lines.append(f"clusters (cluster=NAME, required): {', '.join(clusters)}")
    lines += ["", "groups (group=option):"]
    lines += [f"  {group}={'|'.join(options(conf, group))}" for group in GROUPS if options(conf, group)]
    lines += ["", "keys most runs set (key=value; every key: --cfg job prints the composed configuration):"]
    lines += [f"  {keys:<56} {why}" for keys, why in KEYS]
    lines += ["", "docs: docs/getting-started.md, docs/configuration.md"]
    return "\n".join(lines)


def recipe_description(file: Path) -> str:
    """A recipe's first sentence (its leading comment): what it trains, with which mode (``--help``, a run's
    start)."""
    if not file.is_file():
        return ""
    block = []
    for line in file.read_text().splitlines():
        if not line.startswith("#"):
            break
        block.append(line.lstrip("# ").strip())
    return " ".join(block).split(". ")[0].rstrip(".")


def wants_help(argv: list[str]) -> bool:
    return any(arg in ("-h", "--help") for arg in argv)
