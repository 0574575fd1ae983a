"""Per-shape choice between the fused multi-chunk kernel and SDPA + merge, by measured speed.

The first call with a new signature (dtype, shape, chunk lengths, whether earlier state exists, finalize)
times both paths on scratch copies of the state and remembers the faster one for the process's lifetime.
"""
from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Hashable

import torch

from ..logs import say_once

logger = logging.getLogger(__name__)

_choices: dict[Hashable, str] = {}


def time_ms(prepare: Callable[[], object], run: Callable[[object], None], reps: int = 3) -> float:
    """Median CUDA-event time of run(prepare()) after one warm-up; prepare stays outside the timed region."""
    run(prepare())
    times = []
    for _ in range(reps):
        arg = prepare()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(arg)
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def choose(key: Hashable, candidates: dict[str, tuple[Callable[[], object], Callable[[object], None]]]) -> str:
    """Name of the fastest candidate (prepare, run) for this signature; measured once, then cached."""
    if key not in _choices:
        times = {name: time_ms(prepare, run) for name, (prepare, run) in candidates.items()}
        _choices[key] = min(times, key=times.get)
        say_once(logger, logging.INFO, "attention kernel for %s: %s (%s)", key, _choices[key],
                 ", ".join(f"{name} {ms:.3f} ms" for name, ms in times.items()))
    return _choices[key]


def clear() -> None:
    """Forget every choice (tests, or after the GPU's load changed)."""
    _choices.clear()
