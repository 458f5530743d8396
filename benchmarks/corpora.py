"""The benchmarks' corpora beside the embedded one (``stdlib``), each built under an output folder from what this
machine has (or Debian's package registry): ``packages``, ``copyrights`` and ``fortunes`` (issue 64's: natural
English where validation follows training). ``corpus_digest`` names the corpus a result was measured on."""

from __future__ import annotations

import os
import random
import re
import subprocess
import sysconfig
import tempfile
from pathlib import Path


def packages_corpus(out: Path) -> Path:
    """The installed packages' descriptions, concatenated in name order (about 1 MB here)."""
    path = out / "packages.txt"
    if not path.exists():
        site = Path(sysconfig.get_paths()["purelib"])
        texts = [p.read_text(errors="replace") for p in sorted(site.glob("*.dist-info/METADATA"))]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n\n".join(texts))
    return path


def copyrights_corpus(out: Path, limit: int = 4 << 20) -> Path:
    """The machine's Debian copyright files (``/usr/share/doc/*/copyright``), each distinct text once, in package
    order, up to ``limit`` bytes: English legal prose and notices, held out from every setting's tuning."""
    path = out / "copyrights.txt"
    if not path.exists():
        seen, texts, size = set(), [], 0
        for file in sorted(Path("/usr/share/doc").glob("*/copyright")):
            text = file.read_text(errors="replace")
            if text in seen or size > limit:
                continue
            seen.add(text)
            texts.append(text)
            size += len(text)
        if not texts:
            raise SystemExit("the copyrights corpus reads /usr/share/doc/*/copyright (Debian): none here")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n\n".join(texts))
    return path


FORTUNES = Path("/usr/share/games/fortunes")  # Debian's `fortunes` package (main; BSD-style licence, see its copyright)


def fortunes_corpus(out: Path) -> Path:
    """Natural English text no setting was tuned on: Debian's ``fortunes`` package (quotations, literature, poems,
    jokes and definitions; 2.5 MB, licence in its ``/usr/share/doc/fortunes/copyright``), read where it is installed
    or unpacked from Debian's package registry (``apt-get download fortunes``) into ``out``. Every fortune once,
    ASCII-art files left out, in one fixed shuffled order, so the held-out last 5% is drawn like the rest: on this
    corpus the validation loss follows the training loss (the benchmark prints their gap per run). Which texts a
    machine has depends on the package's version: ``corpus_digest`` names the corpus a result was measured on."""
    path = out / "fortunes.txt"
    if path.exists():
        return path
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as scratch:  # per process: runs started together do not race
        folder = FORTUNES
        if not folder.is_dir():
            debs = Path(scratch)
            subprocess.run(["apt-get", "download", "fortunes"], cwd=debs, check=True, capture_output=True)
            subprocess.run(["dpkg-deb", "-x", next(debs.glob("fortunes_*.deb")), debs / "root"], check=True)
            folder = debs / "root" / FORTUNES.relative_to("/")
        texts = []
        for file in sorted(f for f in folder.iterdir() if f.is_file() and not f.suffix and f.name != "ascii-art"):
            text = file.read_text(errors="replace")
            texts += [t.strip("\n") for t in re.split(r"^%$", text, flags=re.M) if t.strip()]
        texts = list(dict.fromkeys(texts))  # each text once: a duplicate could land on both sides of the split
        random.Random(0).shuffle(texts)
        written = Path(scratch) / "fortunes.txt"
        written.write_text("\n\n".join(texts) + "\n")
        os.replace(written, path)  # whole or absent, never half-written for a run that reads it
    return path


def corpus_digest(path: Path) -> str:
    """The corpus a result was measured on: its bytes' SHA-256 (first 12 hex digits) and size, printed with it."""
    import hashlib

    data = path.read_bytes()
    return f"sha256 {hashlib.sha256(data).hexdigest()[:12]}, {len(data):,} bytes"


CORPORA = {  # beside stdlib, the embedded corpus
    "packages": packages_corpus,
    "copyrights": copyrights_corpus,
    "fortunes": fortunes_corpus,
}
