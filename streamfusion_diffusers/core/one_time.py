"""Seconds this process spent on work a shape does once, at its first call, by kind: the layout's choice, the
attention kernels timed, the layout's process groups made, the compiled blocks' compile. A run record reports what
its call added (`spent` before and after), so that a first step's time is split by cause instead of read as a slow
step."""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

_SPENT: dict[str, float] = {}


@contextmanager
def one_time(kind: str) -> Iterator[None]:
    """Count the seconds of the enclosed work under `kind` (the host's time: these steps synchronize)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        _SPENT[kind] = _SPENT.get(kind, 0.0) + time.perf_counter() - started


def count(kind: str, seconds: float) -> None:
    """Count `seconds` under `kind`, for work timed by someone else's callbacks (dynamo's compile)."""
    _SPENT[kind] = _SPENT.get(kind, 0.0) + seconds


def spent() -> dict[str, float]:
    """The seconds counted so far, by kind."""
    return dict(_SPENT)


def spent_since(before: dict[str, float]) -> dict[str, float]:
    """What was counted since `before` (a `spent()`), by kind; kinds with nothing new left out."""
    return {kind: seconds - before.get(kind, 0.0) for kind, seconds in _SPENT.items()
            if seconds > before.get(kind, 0.0)}


__all__ = ["count", "one_time", "spent", "spent_since"]
