"""``pd2bw-prepare-data`` at scale: throughput and peak memory of preparing a corpus of ``--gb`` gigabytes.

    python benchmarks/prepare_data.py --gb 1            # writes the corpus once under /tmp, then prepares it

The corpus is the embedded text (the Python standard library's source) shuffled by paragraph into 4 MB files
until it reaches the size asked for; the tokenizer is a 2,048-token BPE trained here on the embedded text (as the
issue's measurement of the old preparation used). The command runs as a user runs it, in a subprocess; its memory is
sampled every 0.2 s over the process and its workers: the sum of their proportional set sizes (PSS: pages the
forked workers share with the parent counted once) and the largest single resident set. Prints MB/s and GB.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lightning_pd2bw.data.corpus import read_corpus
from lightning_pd2bw.data.prepare import prepare


def write_corpus(folder: Path, gigabytes: float) -> int:
    """4 MB files of shuffled paragraphs of the embedded corpus; returns the bytes written."""
    folder.mkdir(parents=True, exist_ok=True)
    text = bytes(read_corpus(max_bytes=None).numpy()).decode("utf-8", "replace")
    paragraphs = [p for p in text.split("\n\n") if p.strip()]
    rng, target, written, index = random.Random(0), int(gigabytes * 1e9), 0, 0
    while written < target:
        rng.shuffle(paragraphs)
        text = "\n\n".join(paragraphs)[: 4 << 20]
        (folder / f"part-{index:05d}.txt").write_text(text)
        written, index = written + len(text.encode()), index + 1
    return written


def memory_of(pid: int) -> tuple[int, int]:
    """(sum of PSS, largest RSS) in bytes over ``pid`` and its children."""
    pids = [pid] + [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    pss = rss = 0
    for p in pids:
        try:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines()[1:])
        except OSError:
            continue
        pss += int(fields["Pss"].split()[0]) * 1024
        rss = max(rss, int(fields["Rss"].split()[0]) * 1024)
    return pss, rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--corpus", default=f"{tempfile.gettempdir()}/pd2bw-corpus")
    parser.add_argument("--workers", type=int, default=None)
    args = parser.parse_args()
    corpus = Path(args.corpus) / f"{args.gb:g}gb"
    size = sum(f.stat().st_size for f in corpus.glob("*.txt")) if corpus.is_dir() else 0
    if size < args.gb * 1e9:
        size = write_corpus(corpus, args.gb)
    work = Path(tempfile.mkdtemp(prefix="pd2bw-prepare-"))
    sample = work / "sample.txt"
    sample.write_bytes(bytes(read_corpus().numpy()))
    prepare(work / "tokenizer", [sample], vocab_size=2048, val_fraction=0.0)
    command = [sys.executable, "-m", "lightning_pd2bw.data.prepare", str(work / "out"), str(corpus)]
    command += ["--tokenizer", str(work / "tokenizer" / "tokenizer.json")]
    command += ["--workers", str(args.workers)] if args.workers else []
    start = time.perf_counter()
    process = subprocess.Popen(command)
    peak_pss = peak_rss = 0
    while process.poll() is None:
        pss, rss = memory_of(process.pid)
        peak_pss, peak_rss = max(peak_pss, pss), max(peak_rss, rss)
        time.sleep(0.2)
    seconds = time.perf_counter() - start
    if process.returncode:
        raise SystemExit(process.returncode)
    print(
        f"prepared {size / 1e9:.2f} GB in {seconds:.0f} s: {size / 1e6 / seconds:.1f} MB/s; peak memory "
        f"{peak_pss / 1e9:.2f} GB (PSS, the process and its workers), largest single process {peak_rss / 1e9:.2f} GB"
    )


if __name__ == "__main__":
    main()
