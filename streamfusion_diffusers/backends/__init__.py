"""Transports: how chunks move between ranks. Algorithms see only the `Transport` interface."""
from __future__ import annotations

from .base import Done, Handle, Handles, Transport
from .emulated import EmulatedTransport
from .torch_dist import TorchTransport

__all__ = ["Done", "EmulatedTransport", "Handle", "Handles", "Transport", "TorchTransport", "make_transport"]


def make_transport(backend: str) -> Transport:
    """The transport for ParallelConfig.backend ("torch", or its aliases "nccl" and "gloo")."""
    if backend in ("torch", "nccl", "gloo"):
        return TorchTransport()
    raise ValueError(f"unknown backend {backend!r}; use 'torch'")
