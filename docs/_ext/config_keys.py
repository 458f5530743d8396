"""Every key ``pd2bw-train`` takes and its value in the default recipe, one line each (as an override writes it), from the composed configuration
(the schemas in ``lightning_pd2bw/cli/schemas.py``, the group options and ``recipes/tiny.yaml``): the key table of
``docs/configuration.md``, generated, never typed.

    python docs/_ext/config_keys.py           # rewrite docs/_generated/configuration-keys.md
    python docs/_ext/config_keys.py --check   # exit 1 if it differs from what the configuration composes now
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "_generated" / "configuration-keys.md"


def flat(node: dict, prefix: str = "") -> dict[str, object]:
    """``{"strategy.mode": "2bw", ...}``: the leaves of a composed configuration, ``_target_`` left out."""
    out: dict[str, object] = {}
    for key, value in node.items():
        if key == "_target_":
            continue
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def text(value: object) -> str:
    """The value as a YAML override writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return "{" + ",".join(sorted(value)) + "}"
    if isinstance(value, list):
        return "[" + ",".join(text(v) for v in value) + "]"
    return str(value)


def table() -> str:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from lightning_pd2bw.cli.train import CONF, RECIPES, setup_hydra

    setup_hydra()
    with initialize_config_dir(config_dir=str(RECIPES), version_base="1.3"):
        cfg = compose(config_name="tiny", overrides=[f"hydra.searchpath=[file://{CONF}]"])
    keys = flat(OmegaConf.to_container(cfg, resolve=False))
    return "\n".join(f"{key}={text(value)}" for key, value in keys.items()) + "\n"  # one word a key


def main() -> int:
    generated = table()
    if "--check" in sys.argv[1:]:
        if OUT.read_text() != generated:
            print(f"{OUT.relative_to(ROOT)} is stale: run python docs/_ext/config_keys.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(generated)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
