"""Language-modelling and masked-LM datasets over a byte tensor: fixed windows, deterministic."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

from ..models.core import IGNORE_INDEX, MASK_TOKEN


def _check_length(data: torch.Tensor, seq_len: int, name: str) -> int:
    count = (len(data) - 1) // seq_len
    if count < 1:
        raise ValueError(
            f"the {name} split has {len(data)} bytes, fewer than one sequence of data.seq_len={seq_len}; "
            "give more text or a shorter seq_len"
        )
    return count


class LMDataset(Dataset):
    """Non-overlapping windows: input bytes ``[i*T, (i+1)*T)``, labels shifted by one."""

    def __init__(self, data: torch.Tensor, seq_len: int, name: str = "train") -> None:
        self.data, self.seq_len = data, seq_len
        self.count = _check_length(data, seq_len, name)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.data[index * self.seq_len : (index + 1) * self.seq_len + 1].long()
        return {"input_ids": window[:-1], "labels": window[1:]}


class MLMDataset(Dataset):
    """BERT masking (15% of positions: 80% [MASK], 10% random byte, 10% kept), seeded per item."""

    def __init__(
        self, data: torch.Tensor, seq_len: int, seed: int = 0, mask_prob: float = 0.15, name: str = "train"
    ) -> None:
        self.data, self.seq_len, self.seed, self.mask_prob = data, seq_len, seed, mask_prob
        self.count = _check_length(data, seq_len, name)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        tokens = self.data[index * self.seq_len : (index + 1) * self.seq_len].long()
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        chosen = torch.rand(self.seq_len, generator=generator) < self.mask_prob
        chosen[torch.randint(self.seq_len, (1,), generator=generator)] = True  # at least one target
        action = torch.rand(self.seq_len, generator=generator)
        random_bytes = torch.randint(256, (self.seq_len,), generator=generator)
        inputs = tokens.clone()
        inputs[chosen & (action < 0.8)] = MASK_TOKEN
        swap = chosen & (action >= 0.8) & (action < 0.9)
        inputs[swap] = random_bytes[swap]
        labels = torch.full_like(tokens, IGNORE_INDEX)
        labels[chosen] = tokens[chosen]
        return {"input_ids": inputs, "labels": labels}
