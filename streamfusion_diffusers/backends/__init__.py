"""Transports: how chunks move between ranks. Algorithms see only the `Transport` interface."""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch.distributed as dist

from ..core.logs import say_once
from ..core.transports import TransportSpec, transport_names, transport_spec
from .base import Done, Handle, Handles, Transport
from .emulated import EmulatedTransport
from .torch_dist import TorchTransport
from .watch import TransferFailed, WatchedTransport

__all__ = ["BUILDERS", "Done", "EmulatedTransport", "Handle", "Handles", "TorchTransport", "TransferFailed",
           "Transport", "WatchedTransport", "make_transport", "register_builder"]

logger = logging.getLogger(__name__)

# (strict, timeout_s) -> the transport: how each transport of core/transports.py is built
Builder = Callable[[bool, float], Transport]


def make_transport(backend: str, *, strict: bool = False, timeout_s: float = 300.0) -> Transport:
    """The transport for ParallelConfig.backend, a name or alias of core/transports.py, by its builder.

    A transport that cannot run where it is asked for ("symm-pull" off NCCL or without triton, "nvshmem" without
    nvshmem4py or a GPU) logs one warning with the reason and returns the torch transport, or raises when strict.
    "nvshmem" starts NVSHMEM on every rank (collective).
    """
    spec = transport_spec(backend)
    build = BUILDERS.get(spec.name)
    if build is None:
        raise ValueError(f"backend {spec.name!r} has no builder: add one with "
                         f"streamfusion_diffusers.backends.register_builder({spec.name!r}, build)")
    return build(strict, timeout_s)


def register_builder(name: str, build: Builder) -> None:
    """Say how a transport of core/transports.py is built (its name there, not an alias)."""
    if name not in transport_names():
        raise ValueError(f"transport {name!r} is not in core/transports.py: register_transport(TransportSpec("
                         f"{name!r}, ...)) first")
    BUILDERS[name] = build


def _fallback(spec: TransportSpec, why: str, strict: bool) -> Transport:
    """The torch transport in place of one that cannot run here, said once (an error when strict)."""
    if strict:
        raise ValueError(f"backend {spec.name!r} cannot run: {why}")
    fallback = dist.get_backend() if dist.is_initialized() else "torch.distributed"
    say_once(logger, logging.WARNING, "streamfusion: backend %r cannot run: %s; falling back to the two-sided "
             "torch transport (%s). Set strict=True to make this an error.", spec.name, why, fallback)
    return TorchTransport()


def _torch(strict: bool, timeout_s: float) -> Transport:
    return TorchTransport()


def _symm_pull(strict: bool, timeout_s: float) -> Transport:
    """The symmetric-memory pull transport where it can run (its process groups, triton)."""
    import importlib.util

    spec = transport_spec("symm-pull")
    why = ("the job does not run NCCL on GPUs" if not dist.is_initialized()
           or dist.get_backend() not in spec.process_groups else
           "triton is not installed" if importlib.util.find_spec("triton") is None else None)
    if why is not None:
        return _fallback(spec, why, strict)
    from .symm_pull import SymmPullTransport

    return SymmPullTransport()


def _nvshmem(strict: bool, timeout_s: float) -> Transport:
    from .nvshmem import nvshmem_transport
    from .nvshmem_runtime import NvshmemUnavailable

    try:
        return nvshmem_transport(timeout_s)
    except NvshmemUnavailable as err:
        if strict:
            raise
        return _fallback(transport_spec("nvshmem"), str(err), strict)


BUILDERS: dict[str, Builder] = {"torch": _torch, "symm-pull": _symm_pull, "nvshmem": _nvshmem}
