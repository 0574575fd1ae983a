"""The emulated link's time on a GPU, held without an SM, as a NIC's DMA is.

A NIC moves bytes while every SM computes. A delay kernel cannot stand in for it: measured on an H200
(`benchmarks/link_delay_check.py`), a `torch.cuda._sleep` booked as transfers are posted (after the work queued
so far, so it becomes ready together with the attention queued next) starts only when that attention, whose
blocks fill every SM, is done: the booked transfer does not overlap it, and schedules that hide transfers behind
attention (Torus, the ring passes) were emulated as serial.

`NicQueue` holds each booking on the host instead: a thread waits until the booking's data is ready on the GPU
(an event) and the previous booking on the queue is over, sleeps the booked time, then raises a counter in pinned
memory; the queue's stream waits for that counter with a stream memory operation (`cuStreamWaitValue32`), which
the GPU's front end evaluates, not an SM.

The thread needs the GIL to release a booking, so the main thread must never block on the GPU while holding it.
It does when it runs far ahead: a kernel launch into a full launch queue, a pinned-memory allocation or another
implicitly synchronizing call blocks with the GIL held, the booking the GPU waits for is never released, and
every rank stalls (NCCL's watchdog then reports its coalesced send/recv timed out; our own watchdog thread, also
Python, cannot speak). `book` therefore holds the host, GIL free, while MAX_UNRELEASED bookings are pending: the
queue is the process's (shared by every context of a bench or tune job), so this bounds the host's lead over the
GPU across contexts, which each context's own RUN_AHEAD (watch.py) does not.
"""
from __future__ import annotations

import logging
import queue
import sys
import threading
import time

import torch

from ..core.logs import say_once
from .cuda_driver import check, driver

log = logging.getLogger(__name__)

# a woken booking thread needs the GIL back within this long, also while the main thread launches kernels
_GIL_SWITCH_S = 1e-4
MAX_UNRELEASED = 8  # bookings the host may post beyond the last one the thread released (about two layers)
_ROOM_POLL_S = 2e-4


def _sleep_until(deadline: float) -> None:
    """Sleep, then spin the last 0.2 ms (time.sleep overshoots by tens of microseconds); the spin yields the GIL."""
    while (left := deadline - time.perf_counter()) > 0:
        time.sleep(left - 2e-4 if left > 3e-4 else 0)


class NicQueue:
    """One direction of one rank's NIC: bookings run one after another, each from when its data is ready."""

    def __init__(self, device: torch.device):
        self._driver = driver()
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._done = torch.zeros(1, dtype=torch.int32, pin_memory=True)  # bookings finished, raised by the thread
        self._done_view = self._done.numpy()
        (self._done_ptr,) = check(self._driver.cuMemHostGetDevicePointer(self._done.data_ptr(), 0))
        self._posted = 0
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        if sys.getswitchinterval() > _GIL_SWITCH_S:
            sys.setswitchinterval(_GIL_SWITCH_S)
        threading.Thread(target=self._serve, name=f"emulated-nic-{device}", daemon=True).start()

    def pending(self) -> int:
        """Bookings posted and not yet released by the thread."""
        return self._posted - int(self._done_view[0])

    def state(self) -> str:
        """Its bookings so far, as a hang report says them (read without a lock or a CUDA call)."""
        return f"{self._posted} booked, {int(self._done_view[0])} released"

    def drain(self) -> None:
        """Return once every booking posted so far is released (sleeping: the GIL stays free for the thread)."""
        while self.pending():
            time.sleep(_ROOM_POLL_S)

    def book(self, seconds: float) -> torch.cuda.Event:
        """Hold `seconds` on this queue once the current stream's work so far is done; returns its end event.
        Waits first (sleeping, so the GIL is free) while MAX_UNRELEASED bookings are pending."""
        while self.pending() >= MAX_UNRELEASED:
            time.sleep(_ROOM_POLL_S)
        ready = torch.cuda.current_stream(self.device).record_event()
        self._posted += 1
        self._jobs.put((ready, time.perf_counter(), seconds, self._posted))
        flags = self._driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        check(self._driver.cuStreamWaitValue32(self._driver.CUstream(self.stream.cuda_stream), self._done_ptr,
                                               self._posted, flags))
        return self.stream.record_event()

    def _serve(self) -> None:
        # this thread's CUDA calls (event query / synchronize) in this rank's device, not in a context that the
        # runtime would otherwise create on GPU 0 for the thread
        torch.cuda.set_device(self.device)
        busy_until = 0.0
        while True:
            ready, posted_at, seconds, number = self._jobs.get()
            try:
                if ready.query():  # ready while the queue was busy: starts when the last booking ended, not now
                    start = max(busy_until, posted_at)
                else:
                    ready.synchronize()
                    start = max(time.perf_counter(), busy_until)
                busy_until = start + seconds
                _sleep_until(busy_until)
            except RuntimeError as err:  # a CUDA error: the main thread sees it too; release, keep serving
                say_once(log, logging.WARNING, "emulated link: a booking's wait failed (%s)", err)
            self._done_view[0] = number
