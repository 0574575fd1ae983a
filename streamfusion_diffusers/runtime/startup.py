"""Where a rank's start-up goes, stage by stage: its process made and its modules imported, its process group
joined, diffusers (and what the model needs of transformers) imported, the pipeline built.

A slow start is a question of which stage: spawning and importing (torch, CUDA), NCCL's communicator at the join,
or the build (the model's modules imported, weights made or loaded, parallelized). Each rank marks the end of
each stage with the wall clock (comparable between the processes of one machine). The first stage starts when the
parent asked for the rank (`asked`: a rank forked from a fork server was made after the server's imports, which
count as its own), else at the process's own start, from the kernel (Linux): the interpreter's start-up and the
imports before any of our code runs. `generate` and `serve` print rank 0's split, and run.json keeps it.
"""
from __future__ import annotations

import os
import time

STAGES = ("process and imports", "join", "diffusers imports", "build")  # each ends at the mark in _ENDS' place
_ENDS = ("imported", "joined", "diffusers imported", "built")
_marks: dict[str, float] = {}
_asked: float | None = None  # when the parent asked for this process (wall clock)


def asked(at: float) -> None:
    """The parent asked for this process at `at` (wall clock): where its first stage starts."""
    global _asked
    _asked = at


def process_started() -> float | None:
    """The wall-clock time this process began, from Linux's /proc (None elsewhere): its start in clock ticks since
    boot, against the boot clock now."""
    try:
        with open("/proc/self/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22
    except (OSError, ValueError, IndexError, AttributeError):
        return None
    return time.time() - age


def mark(end: str) -> None:
    """This rank reached the end of a stage (one of _ENDS). A mark made again (a second build in one process)
    begins a new start-up: the earlier marks are another build's, and only the stages after it are known."""
    if end not in _ENDS:
        raise ValueError(f"unknown start-up mark {end!r}: one of {', '.join(_ENDS)}")
    if end in _marks:
        _marks.clear()
    _marks[end] = time.time()


def split() -> dict[str, float]:
    """Seconds each stage took on this rank, for the stages whose start and end are both known."""
    seconds, start = {}, (_asked or process_started()) if _ENDS[0] in _marks else None
    for stage, end in zip(STAGES, _ENDS):
        at = _marks.get(end)
        if start is not None and at is not None:
            seconds[stage] = max(0.0, at - start)
        start = at
    return seconds


def describe(seconds: dict[str, float]) -> str:
    """The split as one phrase: "process and imports 9.1 s, join 2.0 s, ..."."""
    return ", ".join(f"{stage} {sec:.1f} s" for stage, sec in seconds.items())


__all__ = ["STAGES", "asked", "describe", "mark", "process_started", "split"]
