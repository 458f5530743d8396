"""GPT and BERT as LightningModules implementing the partition contract, their plain ``nn.Module`` cores
(``GPTCore``, ``BERTCore``, ``core.py``: no Lightning), and Hugging Face models as pipelines (``HFCausalLM``, ``HFMaskedLM``:
``transformers`` is imported only when one is built). Names are imported on first use, so the core needs only
torch."""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "BERT": "bert",
    "BERTConfig": "core",
    "BERTCore": "core",
    "GPT": "gpt",
    "GPTConfig": "core",
    "GPTCore": "core",
    "TransformerConfig": "core",
    "HFCausalLM": "hf",
    "HFMaskedLM": "hf",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
