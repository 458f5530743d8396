"""Transposable N:M masks: in every ``m`` x ``m`` tile of a weight, at most ``n`` kept weights in each row and in each
column, so that the weight and its transpose are both N:M along their last dimension. A 2:4 GPU kernel then runs the
forward GEMM (``x @ W.t()``: W's groups along the input features) and the input-gradient GEMM (``g @ W``: the groups
along the output features, W's columns) from one mask (Hubara et al. 2021, "Accelerated Sparse Neural Training";
PyTorch's ``SparseSemiStructuredTensorCUTLASS.prune_dense_static_sort`` keeps the same constraint per 4 x 4 tile).

Each tile keeps the pattern of largest total magnitude among all patterns with exactly ``n`` per row and per
column (90 for 2:4, 24 for 3:4): exact, not greedy, and the same on every rank for the same weights (ties go to
the first pattern in a fixed order)."""

from __future__ import annotations

import functools
import itertools

import torch

MAX_TILE = 4  # patterns are enumerated over the 2^(m*m) tiles: m <= 4 (2:4 and 1:4, 3:4 on the way to 2:4)
CHUNK_TILES = 1 << 16  # tiles scored at once (a 13B MLP matrix has 6.5M 4 x 4 tiles: scores in 24 MiB pieces)


@functools.cache
def patterns(n: int, m: int) -> torch.Tensor:
    """Every ``m`` x ``m`` 0/1 pattern with exactly ``n`` ones in each row and each column, as rows of ``m * m``
    (float32, in a fixed order)."""
    if not 0 < n <= m <= MAX_TILE:
        raise ValueError(f"transposable n_of_m: n={n}, m={m}: need 0 < n <= m <= {MAX_TILE} (2:4 is n=2, m=4)")
    rows = [row for row in itertools.product((0, 1), repeat=m) if sum(row) == n]
    found = [
        [x for row in tile for x in row]
        for tile in itertools.product(rows, repeat=m)
        if all(sum(column) == n for column in zip(*tile))
    ]
    return torch.tensor(found, dtype=torch.float32)


def transposable_mask(score: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """The transposable ``n``:``m`` mask of a 2-D ``score`` (magnitudes) whose both dimensions are multiples of
    ``m``: per tile, the pattern keeping the largest total score."""
    rows, cols = score.shape
    choices = patterns(n, m).to(score.device)
    tiles = score.float().reshape(rows // m, m, cols // m, m).transpose(1, 2).reshape(-1, m * m)
    chosen = torch.empty(tiles.shape[0], dtype=torch.long, device=score.device)
    for start in range(0, tiles.shape[0], CHUNK_TILES):
        chosen[start : start + CHUNK_TILES] = (tiles[start : start + CHUNK_TILES] @ choices.t()).argmax(dim=1)
    mask = choices[chosen].bool().reshape(rows // m, cols // m, m, m).transpose(1, 2)
    return mask.reshape(rows, cols)
