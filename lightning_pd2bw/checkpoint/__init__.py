"""Sharded checkpoints: each stage's state as DCP entries under names independent of the layout (``entries``), a
manifest, atomic publication and reading back with resharding (``store``). The Lightning strategy and the CLI use
it; ``consolidate(path)`` gives one whole ``state_dict`` from any checkpoint."""

from .entries import STAGE_KEYS, entries_of, stage_checkpoint
from .store import (
    FORMAT,
    MANIFEST,
    META_FILE,
    OldFormatError,
    consolidate,
    load_stage,
    newest_checkpoint,
    read_entries,
    read_manifest,
    read_meta,
    resolve,
    save_sharded,
)

__all__ = [
    "FORMAT",
    "MANIFEST",
    "META_FILE",
    "STAGE_KEYS",
    "OldFormatError",
    "consolidate",
    "entries_of",
    "load_stage",
    "newest_checkpoint",
    "read_entries",
    "read_manifest",
    "read_meta",
    "resolve",
    "save_sharded",
    "stage_checkpoint",
]
