"""Timing on every rank: CUDA events on GPUs, the host clock on the CPU; the slowest rank per iteration."""
from __future__ import annotations

import faulthandler
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist


def time_ms(call: Callable[[], object], iters: int, warmup: int, device: torch.device) -> list[float]:
    """Milliseconds of each of `iters` calls after `warmup` untimed ones, each the slowest rank's."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(iters):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            start_s = time.perf_counter()
            call()
            times.append((time.perf_counter() - start_s) * 1e3)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


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
