"""Timing on every rank: CUDA events on GPUs, the host clock on the CPU; the slowest rank per sample.

A sample is a batch of n back-to-back calls, its time divided by n, with n chosen once per case after the
warm-up so that a sample lasts at least SAMPLE_MS: a single sub-millisecond call is dominated by the ranks'
start skew after the barrier (the first rank to start waits for its peers inside the call) and by launch
jitter, both of which n calls amortize, as layers do when they run back to back in a model; long calls keep
n = 1. Cases of one job are timed round-robin (sample 1 of every case, then sample 2, ...), so a clock or
thermal drift during the job spreads over every case instead of favouring whichever ran first, and each case
reports min / median / max so that a noisy one shows. `bench` and `tune` time layers through `interleaved_ms`
with the same defaults (ITERS, WARMUP).
"""
from __future__ import annotations

import faulthandler
import gc
import math
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..backends.emulated import nic_state
from ..backends.watchdog import EXIT_CODE, report_and_exit, this_rank, waiting_line

SPREAD_LIMIT = 0.05  # (max - min) / median above which a case is flagged as noisy
SAMPLE_MS = 2.0  # a timed sample lasts at least this long (n back-to-back calls)
MAX_CALLS = 100  # the most calls in one sample (calls of microseconds, e.g. tiny CPU layers)
ITERS, WARMUP = 10, 3  # samples per case and untimed warm-up rounds: bench's and tune's defaults


@dataclass(frozen=True)
class Stats:
    """Min / median / max milliseconds per call of one case's samples (each the slowest rank's), and the
    back-to-back calls each sample timed."""

    min: float
    median: float
    max: float
    calls: int = 1

    @classmethod
    def of(cls, times: Sequence[float], calls: int = 1) -> Stats:
        return cls(min(times), statistics.median(times), max(times), calls)

    @property
    def spread(self) -> float:
        return (self.max - self.min) / self.median if self.median > 0 else 0.0

    @property
    def noisy(self) -> bool:
        return self.spread > SPREAD_LIMIT

    def row(self) -> dict[str, float]:
        """The fields a result row carries: `ms` is the median."""
        return {"ms": self.median, "min_ms": self.min, "max_ms": self.max, "spread": self.spread,
                "calls": self.calls}


def sample_ms(call: Callable[[], object], n: int, device: torch.device) -> float:
    """This rank's milliseconds per call of n back-to-back calls, started together with its peers."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # what was queued before is not timed
    dist.barrier()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n
    start_s = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - start_s) * 1e3 / n


def _slowest(times: list[float], device: torch.device) -> list[float]:
    """Each entry's largest value over the ranks (every rank gets the same list)."""
    found = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(found, op=dist.ReduceOp.MAX)
    return found.tolist()


def calls_per_sample(calls: Sequence[Callable[[], object]], device: torch.device,
                     target_ms: float = SAMPLE_MS) -> list[int]:
    """For each call, the back-to-back calls that make a sample last `target_ms` on the slowest rank (the same
    on every rank). Estimated from one call, then refined from a batch of the estimate where it exceeds one:
    a single call overstates a short call's time by the ranks' start skew."""
    def needed(ms: float) -> int:
        return min(MAX_CALLS, max(1, math.ceil(target_ms / ms))) if ms > 0 else MAX_CALLS

    n = [needed(ms) for ms in _slowest([sample_ms(call, 1, device) for call in calls], device)]
    refined = _slowest([sample_ms(call, k, device) if k > 1 else 0.0 for call, k in zip(calls, n)], device)
    return [needed(ms) if k > 1 else 1 for k, ms in zip(n, refined)]


def interleaved_ms(calls: Sequence[Callable[[], object]], iters: int, warmup: int, device: torch.device,
                   round_timeout_s: float | None = None, target_ms: float = SAMPLE_MS) -> list[Stats]:
    """Stats per call of each of `calls`: `warmup` untimed rounds of one call each, the batch sizing
    (`calls_per_sample`, itself one to n + 1 more calls each; skipped with target_ms=0: one call per sample),
    then `iters` timed rounds of one sample of every call. Every rank must pass the same calls in one order.

    Each round starts one call later than the one before (round-robin start), so no call is always the one that
    runs first after the others. Python's garbage collector waits until the end (a collection in a sample of a
    sub-millisecond call would be its largest cost). round_timeout_s: a round that takes longer prints every
    stack and exits (see `deadline`)."""
    def guard():
        return deadline(round_timeout_s) if round_timeout_s else nullcontext()

    def order(i: int) -> list[int]:
        return [(i + j) % len(calls) for j in range(len(calls))]

    for i in range(warmup):
        with guard():
            for c in order(i):
                calls[c]()
    with guard():
        n = calls_per_sample(calls, device, target_ms) if target_ms > 0 else [1] * len(calls)
    times: list[list[float]] = [[] for _ in calls]
    collecting = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for i in range(warmup, warmup + iters):
            with guard():
                for c in order(i):
                    times[c].append(sample_ms(calls[c], n[c], device))
    finally:
        if collecting:
            gc.enable()
    slowest = torch.tensor(_slowest([t for row in times for t in row], device)).reshape(len(calls), iters)
    return [Stats.of(row, k) for row, k in zip(slowest.tolist(), n)]


def time_ms(call: Callable[[], object], iters: int, warmup: int, device: torch.device) -> list[float]:
    """Milliseconds of each of `iters` calls after `warmup` untimed ones, each the slowest rank's."""
    for _ in range(warmup):
        call()
    return _slowest([sample_ms(call, 1, device) for _ in range(iters)], device)


def median_ms(call: Callable[[], object], iters: int, warmup: int, device: torch.device) -> float:
    return statistics.median(time_ms(call, iters, warmup, device))


BACKSTOP_S = 5.0  # after the deadline, faulthandler's own thread ends a rank whose Python cannot run (GIL held)


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Fail loudly instead of hanging: past `seconds`, print one line naming the transfer this rank waits for
    (backends/watchdog.py), every thread's stack, and exit this rank with watchdog.EXIT_CODE; every rank runs its own
    deadline, so every stuck rank says where it is. A thread that holds the GIL while blocked keeps that line
    from being written: faulthandler's C thread then dumps the stacks and exits BACKSTOP_S later."""
    timer = threading.Timer(seconds, _expired, args=(seconds,))
    timer.daemon = True
    timer.start()
    faulthandler.dump_traceback_later(seconds + BACKSTOP_S, exit=True, file=sys.stderr)
    try:
        yield
    finally:
        timer.cancel()
        faulthandler.cancel_dump_traceback_later()


def _expired(seconds: float) -> None:
    faulthandler.cancel_dump_traceback_later()  # Python runs: the report below, py-spy's included, replaces it
    nic = nic_state()
    report_and_exit(f"streamfusion: rank {this_rank()}: nothing finished within {seconds:g} s (--timeout); "
                    f"{waiting_line()}{'; ' + nic if nic else ''}; every thread's stack follows, then this rank exits "
                    f"(code {EXIT_CODE})")
