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
    """The transport for ParallelConfig.backend: "torch" (or its aliases "nccl" and "gloo") or "nvshmem".

    "nvshmem" starts NVSHMEM on every rank (collective). Where it cannot run (no nvshmem4py, no GPU, a
    start-up failure) it logs one warning with the reason and returns the torch transport, or raises
    NvshmemUnavailable when strict.
    """
    if backend in ("torch", "nccl", "gloo"):
        return TorchTransport()
    if backend != "nvshmem":
        raise ValueError(f"unknown backend {backend!r}; use 'torch' or 'nvshmem'")
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
