"""Sharded checkpoints: each stage's state as DCP entries under names independent of the layout (``entries``), a
manifest, atomic publication and reading back with resharding (``store``), finding a folder's newest complete one
(``finding``), and the engine's ``save``/``load``
(``engine_state``). The strategy and the CLI use it; ``consolidate(path)`` gives one whole ``state_dict`` from any
checkpoint. Every public name of ``store`` (what ``lightning_pd2bw.checkpoint`` was as one module) is here too."""

from .entries import STAGE_KEYS, empty_for, entries_of, request_for, stage_checkpoint
from .finding import incomplete_checkpoints, newest_checkpoint
from .store import (
    FORMAT,
    MANIFEST,
    META_FILE,
    SHARED_PROBE,
    UnreadableCheckpoint,
    check_files,
    check_shared,
    check_shared_folder,
    consolidate,
    finish,
    fsync_file,
    load_stage,
    manifest_for,
    publish,
    read_entries,
    read_manifest,
    read_meta,
    resolve,
    same_layout,
    save_sharded,
    write_meta,
    write_state,
)

__all__ = [
    "FORMAT",
    "MANIFEST",
    "META_FILE",
    "SHARED_PROBE",
    "STAGE_KEYS",
    "UnreadableCheckpoint",
    "check_files",
    "check_shared",
    "check_shared_folder",
    "consolidate",
    "empty_for",
    "entries_of",
    "finish",
    "fsync_file",
    "incomplete_checkpoints",
    "load_stage",
    "manifest_for",
    "newest_checkpoint",
    "publish",
    "read_entries",
    "read_manifest",
    "read_meta",
    "request_for",
    "resolve",
    "same_layout",
    "save_sharded",
    "stage_checkpoint",
    "write_meta",
    "write_state",
]
