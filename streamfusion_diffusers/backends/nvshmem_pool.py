"""The symmetric buffer pool: one receive mailbox per process, allocated once and reused every layer and step.

Symmetric memory has the same address on every PE, but a receive buffer's place must also be known to the
sender without asking. So the pool is cut into one region per sending PE, and inside a layer the n-th
message from PE s to PE d lands at the same offset of region s on d that both sides compute on their own:
the sender counts what it sent to d, the receiver what it expects from s, messages matched in order as
two-sided transports match them. Each message also has a signal word (region s, message n) that the put
sets to 1 when the data has landed. Sizes never need to agree across ranks, only the region capacity,
which every rank derives from the same layer plan (`attention.volume.peer_bytes`).
"""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence

import torch
from torch import Tensor

from ..core.logs import say_once
from .nvshmem_runtime import Runtime, watchdog

logger = logging.getLogger(__name__)

ALIGN = 256  # bytes; every message starts on this boundary
MAX_MESSAGES = 256  # per peer per layer; the Torus schedule sends 2T + 4 at most
GROWTH = 2 << 20  # capacities are rounded up to this, so small changes of sequence length reuse the pool
HEAP_SLACK = 256 << 20  # NVSHMEM's own symmetric allocations (barrier and team state) and rounding


def region_bytes(peer_bytes: int) -> int:
    """One sending PE's region of the mailbox for layers that send at most `peer_bytes` to one peer."""
    return math.ceil((peer_bytes + ALIGN * MAX_MESSAGES) / GROWTH) * GROWTH


def heap_bytes(n_pes: int, peer_bytes: int) -> int:
    """The NVSHMEM symmetric heap (NVSHMEM_SYMMETRIC_SIZE) that holds the mailbox of such layers: every
    region, every signal word and NVSHMEM's own share. The one heap formula: `launch` sizes the job with it
    and the mailbox names it when the heap is too small."""
    return n_pes * region_bytes(peer_bytes) + n_pes * MAX_MESSAGES * 8 + HEAP_SLACK


class HeapExhausted(MemoryError):
    """The NVSHMEM symmetric heap is too small for the mailbox a layer needs."""


class Mailbox:
    """Per-peer receive regions in the symmetric heap, plus one signal word per (peer, message)."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.capacity = 0  # bytes per sending PE
        self.data: Tensor | None = None  # uint8 [n_pes * capacity]
        self.signals: Tensor | None = None  # int64 [n_pes * MAX_MESSAGES]; NVSHMEM reads them as uint64
        self.reset()

    def reserve(self, peer_bytes: int) -> None:
        """Make every region hold `peer_bytes` (plus alignment); collective when it has to grow."""
        need = region_bytes(peer_bytes)
        if self.signals is not None and need <= self.capacity:
            return
        with watchdog("NVSHMEM mailbox allocation (collective over every PE)", self.runtime.timeout_s):
            if self.signals is None:
                self.signals = self._allocate((self.runtime.n_pes * MAX_MESSAGES,), torch.int64, peer_bytes)
                self.signals.zero_()
                torch.cuda.synchronize(self.runtime.device)
            if need <= self.capacity:
                return
            if self.data is not None:
                torch.cuda.synchronize(self.runtime.device)
                self.runtime.core.free_tensor(self.data)
                self.data = None
            self.data = self._allocate((self.runtime.n_pes * need,), torch.uint8, peer_bytes)
            self.capacity = need
        say_once(logger, logging.INFO, "streamfusion: NVSHMEM mailbox %d x %.1f MiB", self.runtime.n_pes,
                 need / 2**20)

    def free(self) -> None:
        """Give the mailbox back to the symmetric heap (collective), as NVSHMEM wants before it finalizes."""
        with watchdog("NVSHMEM mailbox release (collective over every PE)", self.runtime.timeout_s):
            torch.cuda.synchronize(self.runtime.device)
            for buf in (self.data, self.signals):
                if buf is not None:
                    self.runtime.core.free_tensor(buf)
        self.data, self.signals, self.capacity = None, None, 0

    def _allocate(self, shape: tuple[int, ...], dtype: torch.dtype, peer_bytes: int) -> Tensor:
        try:
            return self.runtime.core.tensor(shape, dtype=dtype)
        except Exception as err:  # noqa: BLE001 - nvshmem4py raises its own types
            nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            now = os.environ.get("NVSHMEM_SYMMETRIC_SIZE", "unset: NVSHMEM's default of 1 GiB")
            raise HeapExhausted(
                f"NVSHMEM could not allocate {nbytes} bytes ({nbytes / 2**30:.2f} GiB) of symmetric memory "
                f"({self.runtime.n_pes} peers x {nbytes // self.runtime.n_pes} bytes) for the receive mailbox: "
                f"{err}. Raise NVSHMEM_SYMMETRIC_SIZE (now {now}) to at least "
                f"{heap_bytes(self.runtime.n_pes, peer_bytes)} before the "
                f"job starts; `streamfusion launch` sizes it from --model and --height/--width/--frames") from err

    def reset(self) -> None:
        """Start a layer: message counters back to zero (the signals were cleared by the last layer)."""
        n = self.runtime.n_pes
        self._sent: list[tuple[int, int]] = [(0, 0)] * n  # per destination PE: (bytes, messages)
        self._expected: list[tuple[int, int]] = [(0, 0)] * n  # per source PE

    def _take(self, counters: list[tuple[int, int]], pe: int, nbytes: int) -> tuple[int, int]:
        offset, index = counters[pe]
        if offset + nbytes > self.capacity or index >= MAX_MESSAGES:
            raise HeapExhausted(f"one layer sent more than its plan to or from PE {pe}: {offset + nbytes} bytes in "
                                f"{index + 1} messages, the mailbox holds {self.capacity} in {MAX_MESSAGES}; "
                                f"pass a larger peer_bytes to begin_layer")
        counters[pe] = (offset + math.ceil(nbytes / ALIGN) * ALIGN, index + 1)
        return offset, index

    def outgoing(self, dst: int, nbytes: int) -> tuple[int, int]:
        """(address, signal address) of the next message to PE dst, as symmetric addresses."""
        offset, index = self._take(self._sent, dst, nbytes)
        me = self.runtime.pe
        return (self.data.data_ptr() + me * self.capacity + offset,
                self.signals.data_ptr() + (me * MAX_MESSAGES + index) * 8)

    def incoming(self, src: int, dtype: torch.dtype, shape: Sequence[int]) -> tuple[Tensor, int]:
        """(view, local signal address) of the next message expected from PE src."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        offset, index = self._take(self._expected, src, nbytes)
        start = src * self.capacity + offset
        view = self.data[start:start + nbytes].view(dtype).view(tuple(shape))
        return view, self.signals.data_ptr() + (src * MAX_MESSAGES + index) * 8
