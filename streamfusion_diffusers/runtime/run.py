"""A command's work run once on every rank of a job: the launcher's ranks under torchrun, else a local pool of
`world_size` processes (pool.py) that ends with the work."""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..context import shutdown
from ..core.config import DEFAULT_TIMEOUT_S
from ..core.join import join_job, launched
from . import startup
from .pool import ProcessPool


def run_local(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
              timeout_s: float = DEFAULT_TIMEOUT_S, wait_s: float | None = None,
              ahead: Callable[[], None] | None = None, **kwargs: Any) -> list[Any]:
    """Start `world_size` local processes, run fn on each rank once, and return the per-rank results."""
    with ProcessPool(world_size, backend=backend, timeout_s=timeout_s, wait_s=wait_s, ahead=ahead) as pool:
        return pool.run(fn, *args, **kwargs)


def job_shape(default_world: int, cpu_only: bool = False) -> tuple[int, bool]:
    """(world size, whether to use GPUs) for a job: torchrun's world, or `default_world` local processes that
    get a GPU each when there are enough of them (and `cpu_only` is not asked for)."""
    import torch

    if launched():
        return int(os.environ["WORLD_SIZE"]), torch.cuda.is_available() and not cpu_only
    return default_world, torch.cuda.is_available() and torch.cuda.device_count() >= default_world and not cpu_only


def run_job(fn: Callable[..., Any], world_size: int, *args: Any, gpu: bool,
            timeout_s: float = DEFAULT_TIMEOUT_S, wait_s: float | None = None,
            ahead: Callable[[], None] | None = None) -> list[Any]:
    """Run fn on every rank: join the torchrun job this process belongs to, or spawn `world_size` local ranks.
    ahead: what each rank starts before it joins (`serve_rank`).

    Under torchrun the list holds this rank's result only (every rank returns); locally, every rank's. Under
    torchrun a rank that fails exits, and torchrun stops the others.
    """
    if not launched():
        return run_local(fn, world_size, *args, backend="nccl" if gpu else "gloo", timeout_s=timeout_s,
                         wait_s=wait_s, ahead=ahead)
    startup.mark("imported")
    if ahead is not None:
        ahead()
    owned = join_job(gpu, timeout_s)
    startup.mark("joined")
    try:
        result = fn(*args)
    except BaseException:
        if owned:
            import torch.distributed as dist

            dist.destroy_process_group()
        raise
    if owned:  # together, so that no rank tears down its transport while a peer still uses it
        shutdown()
    return [result]


__all__ = ["job_shape", "run_job", "run_local"]
