"""``python -m lightning_pd2bw.train``: the Hydra entry point, which lives in ``cli/train.py`` (``pd2bw-train``)."""

from .cli.train import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
