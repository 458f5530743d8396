"""What ``pyproject.toml`` cannot say: the top-level ``conf/`` and ``recipes/`` ship inside the wheel as the
package data ``lightning_pd2bw/conf`` and ``lightning_pd2bw/recipes``, so an installed ``pd2bw-train`` composes
its configurations anywhere (a source checkout reads the top-level folders; ``lightning_pd2bw/cli/train.py``)."""

from pathlib import Path

from setuptools import find_packages, setup


def config_packages(top: str) -> dict[str, str]:
    """``conf`` and each folder under it as ``lightning_pd2bw.conf[.group]`` -> its folder."""
    folders = [Path(top), *sorted(p for p in Path(top).rglob("*") if p.is_dir() and p.name != "__pycache__")]
    return {".".join(("lightning_pd2bw", *folder.parts)): folder.as_posix() for folder in folders}


configs = {**config_packages("conf"), **config_packages("recipes")}
setup(
    packages=[*find_packages(include=["lightning_pd2bw*"]), *configs],
    package_dir=configs,
    package_data={**{name: ["*.yaml"] for name in configs}, "lightning_pd2bw.planner": ["*.json"]},
)
