"""2BW's synchronous start, stated once: how many first steps drain after their update (Flush's rule and speed)
before 2BW's delay begins, for a run of a given length, and the line every entry point prints about it. The engine,
the strategy, ``pd2bw-train``, the dry run and the tests read it here."""

from __future__ import annotations

SYNC_START_STEPS = 250  # 2BW's synchronous start: what let it train at Flush's tuned rate (docs/time-to-quality.md)


def sync_start_steps(total_steps: int | None) -> int:
    """2BW's default synchronous start for a run of ``total_steps`` optimizer steps: ``SYNC_START_STEPS``, or half
    of a shorter run (75 of the 150-step main job held where 37 broke); ``None`` (the length unknown): the full
    ``SYNC_START_STEPS``. The one rule behind ``sync_steps=None`` in the engine, the strategy and ``pd2bw-train``."""
    return SYNC_START_STEPS if total_steps is None else min(SYNC_START_STEPS, int(total_steps) // 2)


def mode_line(mode: str, sync_steps: int | None) -> str:
    """``mode=2bw after a synchronous start of 250 steps``: the run's mode, as every entry point prints it."""
    if mode != "2bw" or not sync_steps:
        return f"mode={mode}"
    return f"mode=2bw after a synchronous start of {sync_steps} step{'s' * (sync_steps != 1)}"
