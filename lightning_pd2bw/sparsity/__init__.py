"""Scheduled sparsity (unstructured, and N:M semi-structured): pure schedules, masks, Lightning callbacks, export."""

from .callbacks import (
    GradualMagnitudeSparsity,
    RigL,
    SemiStructuredSparsity,
    SparsityCallback,
    StaticSparsity,
    flops_ratio,
)
from .export import checkpoint_masks, fold_masks
from .masks import DEFAULT_EXCLUDE, MaskUpdate, Sparsifier, select_targets

__all__ = [
    "DEFAULT_EXCLUDE",
    "GradualMagnitudeSparsity",
    "MaskUpdate",
    "RigL",
    "SemiStructuredSparsity",
    "Sparsifier",
    "SparsityCallback",
    "StaticSparsity",
    "checkpoint_masks",
    "flops_ratio",
    "fold_masks",
    "select_targets",
]
