"""The transport interface: what an attention schedule needs from whatever moves the bytes.

A schedule posts transfers, computes on what is already present, then waits. Every call returns at once with
a Handle; `Handle.wait()` orders later work after the transfer (on GPU, by stream dependencies, not by
blocking the host). Peers are positions inside a mesh Group, not global ranks.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from torch import Tensor

from ..mesh import Group


class Handle(Protocol):
    def wait(self) -> None: ...


class Transport(Protocol):
    name: str

    def recv_buffer(self, like: Tensor, shape: Sequence[int], peer: int, group: Group) -> Tensor:
        """A buffer of like's dtype and device that `exchange` will fill from `peer`. One-sided transports hand
        out symmetric memory a peer can write into; it is valid until `end_layer`."""

    def begin_layer(self, peer_bytes: int) -> None:
        """Start one attention layer in which no peer sends this rank more than `peer_bytes` (collective)."""

    def end_layer(self) -> None:
        """Finish the layer: every transfer it posted is complete before later work on the current stream."""

    def exchange(self, sends: Sequence[tuple[Tensor, int]], recvs: Sequence[tuple[Tensor, int]],
                 group: Group) -> Handle:
        """Send each tensor to its peer and receive each buffer from its peer, all in flight together."""

    def all_to_all(self, output: Tensor, input: Tensor, output_splits: Sequence[int],
                   input_splits: Sequence[int], group: Group) -> Handle:
        """Flat all-to-all: input[sum(input_splits[:j]):][:input_splits[j]] goes to peer j; likewise received."""

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
