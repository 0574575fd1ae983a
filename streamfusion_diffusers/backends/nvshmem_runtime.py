"""NVSHMEM for the running torch.distributed job: can it run here, unique-id bootstrap, finalize.

NVSHMEM is one runtime per process, so this module keeps one: PE number = torch.distributed rank, started
by broadcasting rank 0's unique id over the process group (no MPI, no launcher of its own). Starting is
collective: every rank probes first and all agree, so either every rank runs NVSHMEM or none does. The
mesh's groups need no NVSHMEM teams: a Group's ranks are its PE list, and the only collective the
transport uses is BARRIERALL over the world team.
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..core.extras import install_hint
from ..core.logs import say_once

logger = logging.getLogger(__name__)


class NvshmemUnavailable(RuntimeError):
    """NVSHMEM was asked for but cannot run in this job; the message says why."""


@dataclass
class Runtime:
    """The started NVSHMEM runtime of this process."""

    pe: int
    n_pes: int
    device: torch.device
    timeout_s: float
    core: Any  # nvshmem.core
    bindings: Any  # nvshmem.bindings: the raw on-stream calls that take pointers (sub-slices)
    transport: Any = None  # its NvshmemTransport (one symmetric heap, one mailbox), made on first use


# NVSHMEM is initialized once per process and finalized once (a library-wide state, as torch.distributed's default
# group is): the runtime mirrors that, and what lives in its heap (the transport's mailbox) hangs off it. Every
# context shares it; shutdown() (core/context.py), which ends the job, is its one teardown (nvshmem.close).


_runtime: Runtime | None = None


def _probe() -> str | None:
    """Why NVSHMEM cannot run in this process, or None when it can be tried."""
    if not dist.is_initialized():
        return "torch.distributed is not initialized"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    if dist.get_backend() != "nccl":
        return f"the process group runs {dist.get_backend()!r}, not 'nccl'"
    try:
        import nvshmem.core  # noqa: F401
        from cuda.core import Device  # noqa: F401
    except ImportError as err:
        return f"nvshmem4py is not installed ({err}); " + install_hint("nvshmem")
    return None


def _all_ok(ok: bool) -> bool:
    """True when `ok` holds on every rank (a MIN all-reduce over the world)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


@contextmanager
def watchdog(what: str, timeout_s: float) -> Iterator[None]:
    """Bound a blocking NVSHMEM call that no Python timeout can interrupt: past timeout_s the process exits
    with an error naming `what`, instead of hanging the whole job forever."""

    def expire() -> None:
        logger.critical("streamfusion: %s did not finish within %.0f s (a peer died or cannot be reached); "
                        "exiting this process", what, timeout_s)
        os._exit(70)

    timer = threading.Timer(timeout_s, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def start(timeout_s: float) -> Runtime:
    """Start NVSHMEM on every rank of the job (once per process; collective on first call).

    Raises NvshmemUnavailable, on every rank alike, when any rank lacks the package or a GPU, or the
    runtime fails to start.
    """
    global _runtime
    if _runtime is not None:
        return _runtime
    reason = _probe()
    if not dist.is_initialized():
        raise NvshmemUnavailable(reason)
    if not _all_ok(reason is None):
        raise NvshmemUnavailable(reason or "another rank cannot run NVSHMEM (its log says why)")
    import numpy as np
    import nvshmem.bindings as bindings
    import nvshmem.core as core
    from cuda.core import Device

    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device())
    error = None
    try:
        cuda_device = Device(device.index)
        cuda_device.set_current()
        uid = core.get_unique_id(empty=rank != 0)
        raw = uid._data.view(np.uint8)  # the id's bytes; nvshmem4py keeps them in a numpy array
        shared = torch.from_numpy(raw.copy()).to(device)
        dist.broadcast(shared, 0)
        raw[:] = shared.cpu().numpy()
        with watchdog("NVSHMEM start-up", timeout_s):
            core.init(device=cuda_device, uid=uid, rank=rank, nranks=world, initializer_method="uid")
    except Exception as err:  # noqa: BLE001 - any start-up failure becomes the fallback's reason
        error = f"NVSHMEM failed to start: {type(err).__name__}: {err}"
    if not _all_ok(error is None):
        if error is None:  # started here but not everywhere: a partial runtime cannot be used or left running
            raise RuntimeError("NVSHMEM started on some ranks only; see the other ranks' logs")
        raise NvshmemUnavailable(error)
    _runtime = Runtime(rank, world, device, timeout_s, core, bindings)
    say_once(logger, logging.INFO, "streamfusion: NVSHMEM %s started on %d PEs", core.get_version(), world)
    return _runtime


def finalize() -> None:
    """Finalize NVSHMEM on every rank (it frees the symmetric heap); bounded by the job's timeout."""
    global _runtime
    if _runtime is None:
        return
    runtime, _runtime = _runtime, None
    torch.cuda.synchronize(runtime.device)
    with watchdog("NVSHMEM finalize", runtime.timeout_s):
        runtime.core.finalize()


def current() -> Runtime | None:
    """The started runtime of this process, if any."""
    return _runtime
