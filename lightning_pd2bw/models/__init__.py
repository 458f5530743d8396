"""GPT and BERT as LightningModules implementing the partition contract, and Hugging Face models as pipelines
(``HFCausalLM``, ``HFMaskedLM``: ``transformers`` is imported only when one is built)."""

from .bert import BERT, BERTConfig
from .gpt import GPT, GPTConfig
from .hf import HFCausalLM, HFMaskedLM

__all__ = ["BERT", "BERTConfig", "GPT", "GPTConfig", "HFCausalLM", "HFMaskedLM"]
