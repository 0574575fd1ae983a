"""The transport interface: what an attention schedule needs from whatever moves the bytes.

A schedule posts transfers, computes on what is already present, then waits. Every call returns at once with
a Handle; `Handle.wait()` orders later work after the transfer (on GPU, by stream dependencies, not by
blocking the host). Peers are positions inside a mesh Group, not global ranks.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from torch import Tensor

from ..core.mesh import Group


class Handle(Protocol):
    def wait(self) -> None: ...


class Transport(Protocol):
    name: str  # what logs and run.json say moved the bytes, wrappers included ("torch+int8")
    kind: str  # its entry in core/transports.py, what capability checks read (wrappers pass it through)

    def recv_buffer(self, like: Tensor, shape: Sequence[int], peer: int, group: Group) -> Tensor:
        """A buffer of like's dtype and device that `exchange` will fill from `peer`. One-sided transports hand
        out symmetric memory a peer can write into; it is valid until `end_layer`."""

    def staging(self, group: Group, like: Tensor, shape: Sequence[int]) -> Tensor | None:
        """A buffer of like's dtype and `shape` to pack the next even `all_to_all`'s sends on `group` into,
        where the transport sends from buffers of its own (then it moves them from there without a copy); None
        where it does not. Every member asks for it at the same exchange."""

    def begin_layer(self, peer_bytes: int) -> None:
        """Start one attention layer in which no peer sends this rank more than `peer_bytes` (collective)."""

    def end_layer(self) -> None:
        """Finish the layer: every transfer it posted is complete before later work on the current stream."""

    def exchange(self, sends: Sequence[tuple[Tensor, int]], recvs: Sequence[tuple[Tensor, int]],
                 group: Group) -> Handle:
        """Send each tensor to its peer and receive each buffer from its peer, all in flight together."""

    def all_to_all(self, sends: Sequence[Sequence[Tensor]], recvs: Sequence[Sequence[Tensor]],
                   group: Group) -> Handle:
        """All-to-all of pieces: peer j's recvs[me][n] receives this rank's sends[j][n] (same shape), every
        piece of every peer in one collective; sends[me] is copied into recvs[me] while the others travel.
        A receive may be any view, a strided slice of the caller's result included: where a transport cannot
        write it in place it receives into a buffer and copies it there at wait(). So the caller lays out
        its result in the transfer itself, with no layout copy after it."""

    def all_gather(self, output: Tensor, input: Tensor, group: Group) -> Handle:
        """output[i] = peer i's input (output has a leading dimension of the group's size)."""


class Done:
    """A Handle for work that already finished (local copies, empty transfers)."""

    def wait(self) -> None:
        return None


class Handles:
    """Several handles waited on as one."""

    def __init__(self, handles: Sequence[Handle]):
        self._handles = list(handles)

    def wait(self) -> None:
        for handle in self._handles:
            handle.wait()
        self._handles = []


class Placed:
    """A Handle whose received buffers stand in for views the transport could not write: wait() copies each
    buffer into its view once the transfer has arrived."""

    def __init__(self, inner: Handle, copies: Sequence[tuple[Tensor, Tensor]]):
        self._inner, self._copies = inner, list(copies)

    def wait(self) -> None:
        self._inner.wait()
        for view, buffer in self._copies:
            view.copy_(buffer)
        self._copies = []
