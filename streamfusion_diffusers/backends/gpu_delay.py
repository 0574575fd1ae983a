"""The emulated link's time on a GPU, held by a copy engine, as a NIC's DMA is: no SM, no host thread.

A NIC moves bytes while every SM computes. A delay kernel cannot stand in for it
(`benchmarks/link_delay_check.py`): a `torch.cuda._sleep` booked as transfers are posted starts only when the
attention queued before it, whose blocks fill every SM, is done, so schedules that hide transfers behind attention
(Torus, the ring passes) would be emulated as serial.

A host thread that sleeps the booked time and then releases the GPU overlaps, but the GPU then waits on Python:
a host blocked in a CUDA call at the wrong moment, or a thread that cannot get the GIL back, leaves a booking
unreleased and every rank stalled (BENCHMARKS.md: the emulated steps that stopped).

`NicQueue` books on the copy engines instead: a booking of `seconds` is a copy between pinned host memory and the
GPU, sized by the rate this queue measured, on the queue's stream after the work queued so far. The copy engines
run it beside kernels that fill every SM (a host-to-device copy keeps its time beside a full-SM GEMM:
`benchmarks/ce_a2a_probe.py`), the PCIe link it crosses is not the NVLink the real transfer uses, and nothing on
the host takes part: the host never waits for it, and a CUDA graph captures and replays it. The outgoing queue
copies to the GPU and the incoming one from it, so the two directions of PCIe hold one each.
"""
from __future__ import annotations

import statistics

import torch

from .cuda_driver import check, driver

CHUNK_BYTES = 64 << 20  # one copy's most: a longer booking is several copies of the same buffers
_CALIBRATION_BYTES = (1 << 20, CHUNK_BYTES)
_CALIBRATION_REPEATS = 5


class NicQueue:
    """One direction of one rank's NIC: bookings run one after another on its stream, each from when the data
    booked is ready; `to_gpu` chooses the copy's direction (the outgoing queue True, the incoming False)."""

    def __init__(self, device: torch.device, to_gpu: bool):
        self._driver = driver()
        self.device, self.to_gpu = device, to_gpu
        self.stream = torch.cuda.Stream(device)
        self._host = torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)
        self._gpu = torch.empty(CHUNK_BYTES, dtype=torch.uint8, device=device)
        # bookings over, raised by the GPU's front end after each booking: a hang report reads it with no CUDA call
        self._done = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self._done_view = self._done.numpy()
        (self._done_ptr,) = check(self._driver.cuMemHostGetDevicePointer(self._done.data_ptr(), 0))
        self._posted = 0
        self.fixed_s, self.bytes_per_s = self._calibrate()

    def state(self) -> str:
        """Its bookings so far, as a hang report says them (read without a lock or a CUDA call; replays of a
        captured booking are not counted)."""
        return f"{self._posted} booked, {int(self._done_view[0])} over"

    def book(self, seconds: float) -> torch.cuda.Event:
        """Hold `seconds` on this queue once the current stream's work so far is done; returns its end event."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self._copy(round(max(seconds - self.fixed_s, 0.0) * self.bytes_per_s))
        if not torch.cuda.is_current_stream_capturing():
            self._posted += 1
            check(self._driver.cuStreamWriteValue32(self._driver.CUstream(self.stream.cuda_stream), self._done_ptr,
                                                    self._posted, 0))
        return self.stream.record_event()

    def _copy(self, nbytes: int) -> None:
        """`nbytes` moved on the queue's stream, in copies of at most CHUNK_BYTES."""
        drv, stream = self._driver, self._driver.CUstream(self.stream.cuda_stream)
        host, gpu = self._host.data_ptr(), drv.CUdeviceptr(self._gpu.data_ptr())
        while nbytes > 0:
            n = min(nbytes, CHUNK_BYTES)
            if self.to_gpu:
                check(drv.cuMemcpyHtoDAsync(gpu, host, n, stream))
            else:
                check(drv.cuMemcpyDtoHAsync(host, gpu, n, stream))
            nbytes -= n

    def _calibrate(self) -> tuple[float, float]:
        """(seconds every booking takes, bytes per second): a line through the median times of two copy sizes,
        each copy timed alone on the queue's stream."""
        times = []
        for nbytes in _CALIBRATION_BYTES:
            samples = []
            for _ in range(_CALIBRATION_REPEATS + 1):  # the first one warms up
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(self.stream)
                self._copy(nbytes)
                end.record(self.stream)
                end.synchronize()
                samples.append(start.elapsed_time(end) * 1e-3)
            times.append(statistics.median(samples[1:]))
        (small, large), (t_small, t_large) = _CALIBRATION_BYTES, times
        bytes_per_s = (large - small) / max(t_large - t_small, 1e-9)
        return max(t_small - small / bytes_per_s, 0.0), bytes_per_s


__all__ = ["CHUNK_BYTES", "NicQueue"]
