"""Finding a run's checkpoints in a folder: the newest complete one (``ckpt_path=last``) and the saves passed over for
want of a manifest (named to the user, never skipped in silence)."""

from __future__ import annotations

from pathlib import Path

from .store import MANIFEST, META_FILE, UnreadableCheckpoint, read_manifest, resolve


def newest_checkpoint(directory: str | Path) -> Path | None:
    """The complete pd2bw checkpoint in ``directory`` with the highest global step (then the newest), or None.
    Unpublished saves (``*.tmp``, no manifest) are skipped; a crash between the two renames counts as its path.
    A published checkpoint that cannot be read (``UnreadableCheckpoint``) raises rather than being passed over. A
    link (``last.ckpt``) counts as, and is named by, the checkpoint it points to."""
    found = []
    for path in Path(directory).glob("*") if Path(directory).is_dir() else []:
        if path.name.endswith((".tmp", ".old")) or not path.is_dir():
            continue
        if path.is_symlink():
            path = path.resolve()
        try:
            manifest = read_manifest(path)
        except UnreadableCheckpoint:
            raise
        except (FileNotFoundError, ValueError):
            continue
        found.append((manifest["global_step"], resolve(path).stat().st_mtime, path))
    for old in Path(directory).glob("*.old") if Path(directory).is_dir() else []:
        path = old.with_name(old.name[: -len(".old")])
        if not path.exists() and (old / MANIFEST).is_file():  # published, then crashed before the swap finished
            found.append((read_manifest(path)["global_step"], old.stat().st_mtime, path))
    return max(found)[2] if found else None


def incomplete_checkpoints(directory: str | Path) -> list[Path]:
    """The folders in ``directory`` that ``newest_checkpoint`` passes over for want of a manifest (its completeness
    record): unpublished saves (``*.tmp``) and checkpoints whose ``manifest.json`` is gone, newest first."""
    folder = Path(directory)
    if not folder.is_dir():
        return []
    found = [
        path
        for path in folder.glob("*")
        if path.is_dir()
        and not path.is_symlink()
        and not path.name.endswith(".old")
        and not (path / MANIFEST).is_file()
        and (path.name.endswith(".tmp") or (path / ".metadata").is_file() or (path / META_FILE).is_file())
    ]
    return sorted(found, key=lambda p: p.stat().st_mtime, reverse=True)
