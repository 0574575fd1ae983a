"""Local multi-process jobs on one machine: gloo on the CPU, NCCL with one GPU per process.

`run_local` is a one-shot job (used by `streamfusion verify` and `generate`); `ProcessPool` keeps the same
workers and process group alive across many calls, so a test module pays the start-up cost once.
"""
from __future__ import annotations

import datetime
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from .context import shutdown

DEFAULT_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank: int, world_size: int, port: int, backend: str, timeout_s: float) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import torch

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def _worker(rank: int, world_size: int, port: int, backend: str, timeout_s: float,
            inbox: mp.Queue, outbox: mp.Queue) -> None:
    try:
        _init(rank, world_size, port, backend, timeout_s)
    except Exception:  # noqa: BLE001 - report start-up failures to the parent instead of hanging it
        outbox.put((rank, False, traceback.format_exc()))
        return
    outbox.put((rank, True, None))
    while (task := inbox.get()) is not None:
        fn, args, kwargs = task
        try:
            outbox.put((rank, True, fn(*args, **kwargs)))
        except Exception:  # noqa: BLE001
            outbox.put((rank, False, traceback.format_exc()))
    shutdown()


class ProcessPool:
    """`world_size` processes joined in one process group, running functions on every rank on request."""

    def __init__(self, world_size: int, backend: str = "gloo", timeout_s: float = DEFAULT_TIMEOUT_S):
        self.world_size, self.timeout_s = world_size, timeout_s
        ctx = mp.get_context("spawn")
        port = free_port()
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        self._outbox = ctx.Queue()
        self._procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, backend, timeout_s, self._inboxes[r], self._outbox),
                        daemon=True)
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._collect("start-up")

    def _collect(self, what: str) -> list[Any]:
        results: list[Any] = [None] * self.world_size
        errors = []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self._outbox.get(timeout=self.timeout_s)
            except queue.Empty:
                self.close()
                raise TimeoutError(f"{what}: no answer from every rank within {self.timeout_s:.0f} s") from None
            if ok:
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            self.close()
            raise RuntimeError(f"{what} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
        return results

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run fn(*args, **kwargs) on every rank (fn must be importable by name); return the per-rank results."""
        if not self._procs:
            raise RuntimeError("the process pool is closed")
        for inbox in self._inboxes:
            inbox.put((fn, args, kwargs))
        return self._collect(getattr(fn, "__name__", "task"))

    def close(self) -> None:
        for inbox, proc in zip(self._inboxes, self._procs):
            if proc.is_alive():
                inbox.put(None)
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self._procs = []

    def __enter__(self) -> ProcessPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_local(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
              timeout_s: float = DEFAULT_TIMEOUT_S, **kwargs: Any) -> list[Any]:
    """Start `world_size` local processes, run fn on each rank once, and return the per-rank results."""
    with ProcessPool(world_size, backend=backend, timeout_s=timeout_s) as pool:
        return pool.run(fn, *args, **kwargs)


def under_torchrun() -> bool:
    """True when this process is one rank of a job started by torchrun (or `streamfusion launch`)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def job_shape(default_world: int, cpu_only: bool = False) -> tuple[int, bool]:
    """(world size, whether to use GPUs) for a job: torchrun's world, or `default_world` local processes that
    get a GPU each when there are enough of them (and `cpu_only` is not asked for)."""
    import torch

    if under_torchrun():
        return int(os.environ["WORLD_SIZE"]), torch.cuda.is_available() and not cpu_only
    return default_world, torch.cuda.is_available() and torch.cuda.device_count() >= default_world and not cpu_only


def run_job(fn: Callable[..., Any], world_size: int, *args: Any, gpu: bool,
            timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """Run fn on every rank: join the torchrun job this process belongs to, or spawn `world_size` local ranks.

    Under torchrun the list holds this rank's result only (every rank returns); locally, every rank's.
    """
    backend = "nccl" if gpu else "gloo"
    if not under_torchrun():
        return run_local(fn, world_size, *args, backend=backend, timeout_s=timeout_s)
    owned = not dist.is_initialized()
    if owned:
        if gpu:
            import torch

            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result = fn(*args)
    except BaseException:
        if owned:
            dist.destroy_process_group()
        raise
    if owned:  # together, so that no rank tears down its transport while a peer still uses it
        shutdown()
    return [result]
