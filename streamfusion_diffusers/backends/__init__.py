"""Transports: how chunks move between ranks. Algorithms see only the `Transport` interface."""
from __future__ import annotations

import logging

import torch.distributed as dist

from ..core.logs import say_once
from .base import Done, Handle, Handles, Transport
from .emulated import EmulatedTransport
from .torch_dist import TorchTransport
from .watch import TransferFailed, WatchedTransport

__all__ = ["Done", "EmulatedTransport", "Handle", "Handles", "TorchTransport", "TransferFailed", "Transport",
           "WatchedTransport", "make_transport"]

logger = logging.getLogger(__name__)


def make_transport(backend: str, *, strict: bool = False, timeout_s: float = 300.0) -> Transport:
    """The transport for ParallelConfig.backend: "torch" (or its aliases "nccl" and "gloo"), "symm-pull" (the
    torch transport with its even all-to-alls as one kernel of peer loads from symmetric memory, symm_pull.py) or
    "nvshmem".

    "nvshmem" starts NVSHMEM on every rank (collective). Where it cannot run (no nvshmem4py, no GPU, a
    start-up failure) it logs one warning with the reason and returns the torch transport, or raises
    NvshmemUnavailable when strict.
    """
    if backend in ("torch", "nccl", "gloo"):
        return TorchTransport()
    if backend == "symm-pull":
        return _symm_pull(strict)
    if backend != "nvshmem":
        raise ValueError(f"unknown backend {backend!r}; use 'torch', 'symm-pull' or 'nvshmem'")
    from .nvshmem import nvshmem_transport
    from .nvshmem_runtime import NvshmemUnavailable

    try:
        return nvshmem_transport(timeout_s)
    except NvshmemUnavailable as err:
        if strict:
            raise
        fallback = dist.get_backend() if dist.is_initialized() else "torch.distributed"
        say_once(logger, logging.WARNING, "streamfusion: backend 'nvshmem' cannot run: %s; falling back to the "
                 "two-sided torch transport (%s). Set strict=True to make this an error.", err, fallback)
        return TorchTransport()


def _symm_pull(strict: bool) -> Transport:
    """The symmetric-memory pull transport where it can run (NCCL on GPUs, triton), else the torch transport with
    one warning (or an error when strict)."""
    import importlib.util

    why = ("the job does not run NCCL on GPUs" if not dist.is_initialized() or dist.get_backend() != "nccl" else
           "triton is not installed" if importlib.util.find_spec("triton") is None else None)
    if why is None:
        from .symm_pull import SymmPullTransport

        return SymmPullTransport()
    if strict:
        raise ValueError(f"backend 'symm-pull' cannot run: {why}")
    say_once(logger, logging.WARNING, "streamfusion: backend 'symm-pull' cannot run: %s; using the torch "
             "transport. Set strict=True to make this an error.", why)
    return TorchTransport()
