"""GPT and BERT as LightningModules implementing the partition contract."""

from .bert import BERT, BERTConfig
from .gpt import GPT, GPTConfig

__all__ = ["BERT", "BERTConfig", "GPT", "GPTConfig"]
