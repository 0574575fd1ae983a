"""Timing on every rank: CUDA events on GPUs, the host clock on the CPU; the slowest rank per repetition.

Cases of one job are timed round-robin (repetition 1 of every case, then repetition 2, ...), so a clock or
thermal drift during the job spreads over every case instead of favouring whichever ran first, and each case
reports min / median / max so that a noisy one shows.
"""
from __future__ import annotations

import faulthandler
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

SPREAD_LIMIT = 0.05  # (max - min) / median above which a case is flagged as noisy


@dataclass(frozen=True)
class Stats:
    """Min / median / max milliseconds of one case's repetitions (each the slowest rank's)."""

    min: float
    median: float
    max: float

    @classmethod
    def of(cls, times: Sequence[float]) -> Stats:
        return cls(min(times), statistics.median(times), max(times))

    @property
    def spread(self) -> float:
        return (self.max - self.min) / self.median if self.median > 0 else 0.0

    @property
    def noisy(self) -> bool:
        return self.spread > SPREAD_LIMIT

    def row(self) -> dict[str, float]:
        """The fields a result row carries: `ms` is the median."""
        return {"ms": self.median, "min_ms": self.min, "max_ms": self.max, "spread": self.spread}


def _once_ms(call: Callable[[], object], device: torch.device) -> float:
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    start_s = time.perf_counter()
    call()
    return (time.perf_counter() - start_s) * 1e3


def interleaved_ms(calls: Sequence[Callable[[], object]], iters: int, warmup: int, device: torch.device,
                   round_timeout_s: float | None = None) -> list[Stats]:
    """Stats of each call: `warmup` untimed rounds, then `iters` timed rounds of one repetition of every call.

    Each round starts one call later than the one before (round-robin start), so no call is always the one that
    runs first after the others. round_timeout_s: a round that takes longer prints every stack and exits (see
    `deadline`)."""
    times: list[list[float]] = [[] for _ in calls]
    for i in range(warmup + iters):
        with deadline(round_timeout_s) if round_timeout_s else nullcontext():
            for j in range(len(calls)):
                c = (i + j) % len(calls)
                if i < warmup:
                    calls[c]()
                else:
                    times[c].append(_once_ms(calls[c], device))
    slowest = torch.tensor(times, dtype=torch.float64, device=device).reshape(len(calls), iters)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return [Stats.of(row) for row in slowest.tolist()]


def time_ms(call: Callable[[], object], iters: int, warmup: int, device: torch.device) -> list[float]:
    """Milliseconds of each of `iters` calls after `warmup` untimed ones, each the slowest rank's."""
    for _ in range(warmup):
        call()
    times = torch.tensor([_once_ms(call, device) for _ in range(iters)], dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times.tolist()


def median_ms(call: Callable[[], object], iters: int, warmup: int, device: torch.device) -> float:
    return statistics.median(time_ms(call, iters, warmup, device))


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Fail loudly instead of hanging: past `seconds`, print every thread's stack to stderr and exit this rank
    (its peers then fail on the process group's timeout)."""
    faulthandler.dump_traceback_later(seconds, exit=True, file=sys.stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
