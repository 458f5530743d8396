"""Hydra entry point: ``pd2bw-train [recipe=NAME] [overrides...]`` (also ``python -m lightning_pd2bw.train``).

``recipe=NAME`` selects ``recipes/NAME.yaml`` (default: ``tiny``), a whole experiment built on
``conf/config.yaml``. Lightning's launcher re-runs this command in each rank and Hydra's run
directory is shared, so all ranks write one output directory.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONF, RECIPES = ROOT / "conf", ROOT / "recipes"


def _select_recipe(argv: list[str]) -> list[str]:
    """Turn ``recipe=NAME`` into Hydra's ``--config-name NAME`` (recipes are primary configs)."""
    names = sorted(p.stem for p in RECIPES.glob("*.yaml"))
    out, recipe = [], "tiny"
    for arg in argv:
        if arg.startswith("recipe="):
            recipe = arg.split("=", 1)[1]
        else:
            out.append(arg)
    if "--config-name" in out or any(a.startswith("--config-name=") for a in out):
        return out
    if recipe not in names:
        raise SystemExit(f"recipe={recipe!r} is not a recipe; valid: {', '.join(names)}")
    return ["--config-name", recipe, *out, f"hydra.searchpath=[file://{CONF}]"]


def run(cfg) -> dict:
    import lightning.pytorch as pl
    import torch
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    import lightning_pd2bw  # noqa: F401  (registers the strategy)

    torch.set_num_threads(max(1, torch.get_num_threads() // max(1, int(cfg.trainer.devices))))
    pl.seed_everything(cfg.seed, workers=True)
    model = instantiate(cfg.model)
    data = instantiate(cfg.data)
    strategy = instantiate(cfg.strategy)
    logger = instantiate(cfg.logger) if cfg.get("logger") else False
    trainer = instantiate(cfg.trainer, strategy=strategy, logger=logger)
    if trainer.is_global_zero:
        out = Path(cfg.paths.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        per_replica = cfg.data.batch_size * cfg.data.seq_len
        print(f"tokens per step per replica = {cfg.data.batch_size} x {cfg.data.seq_len} = {per_replica}")
    trainer.fit(model, datamodule=data, ckpt_path=cfg.ckpt_path)
    summary = {k: float(v) for k, v in trainer.callback_metrics.items()}
    summary["global_step"] = trainer.global_step
    if trainer.is_global_zero:
        path = Path(cfg.paths.output_dir) / "summary.json"
        path.write_text(json.dumps(summary, indent=2))
        print(f"summary: {json.dumps(summary)}\nrun directory: {cfg.paths.output_dir}")
    return summary


def main() -> None:
    import hydra

    sys.argv = [sys.argv[0], *_select_recipe(sys.argv[1:])]
    hydra.main(version_base="1.3", config_path=str(RECIPES), config_name="tiny")(run)()


if __name__ == "__main__":
    main()
