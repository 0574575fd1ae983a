"""Does the emulated link's delay overlap attention the way a NIC's transfer does?

A NIC moves bytes without SMs, so a booked transfer of D ms posted beside an A ms attention kernel should end
max(A, D) ms after both become ready. This times a booking beside a full-GPU cuDNN attention (the Flux 4096 px
Ulysses U2 share, about 10 ms on an H200), both waiting on the same preceding kernel, as in a layer:

- sleep: the old booking, `torch.cuda._sleep` cycles on a side stream (needs an SM to run);
- nic: `NicQueue`, a copy between pinned host memory and the GPU sized to the booked time (a copy engine, no SM).

Columns: the delay alone (idle GPU), the attention's end, the booking's end, the ideal max(A, D), and the
excess over it; then a train of 50 bookings of 0.1 ms on one queue (ideal 5 ms). Medians of 5.
    PYTHONPATH=$PWD python3 benchmarks/link_delay_check.py
"""
from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from streamfusion_diffusers.backends.emulated import sleep_cycles_per_second
from streamfusion_diffusers.backends.gpu_delay import NicQueue


def main() -> None:
    dev = torch.device("cuda", 0)
    q = torch.randn(1, 12, 33024, 128, device=dev, dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    rate = sleep_cycles_per_second(dev)
    side, nic = torch.cuda.Stream(dev), NicQueue(dev, to_gpu=True)

    def book(kind: str, seconds: float) -> torch.cuda.Event:
        if kind == "nic":
            return nic.book(seconds)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            torch.cuda._sleep(max(1, int(seconds * rate)))
        return side.record_event()

    def timed(kind: str, seconds: float, attend: bool, bookings: int = 1) -> tuple[float, float]:
        stream = torch.cuda.current_stream(dev)
        start, attn_end, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        torch.cuda._sleep(int(2e-3 * rate))  # the host is ahead of the GPU, as in a layer
        start.record()
        booked = [book(kind, seconds) for _ in range(bookings)]
        if attend:
            F.scaled_dot_product_attention(q, k, v)
        attn_end.record()
        stream.wait_event(booked[-1])
        end.record()
        end.synchronize()
        return start.elapsed_time(attn_end), start.elapsed_time(end)

    for _ in range(3):
        for kind in ("sleep", "nic"):
            timed(kind, 1e-3, True)
    print("primitive  D ms   alone  attention  booking  ideal  excess")
    for seconds in (1e-3, 5e-3, 10e-3, 20e-3):
        for kind in ("sleep", "nic"):
            alone = statistics.median(timed(kind, seconds, False)[1] for _ in range(5))
            runs = [timed(kind, seconds, True) for _ in range(5)]
            attn, both = (statistics.median(r[i] for r in runs) for i in (0, 1))
            ideal = max(attn, seconds * 1e3)
            print(f"{kind:9s} {seconds * 1e3:5.1f} {alone:7.2f} {attn:10.2f} {both:8.2f} {ideal:6.2f} "
                  f"{both / ideal - 1:+6.1%}")
    for kind in ("sleep", "nic"):
        train = statistics.median(timed(kind, 1e-4, False, bookings=50)[1] for _ in range(5))
        print(f"{kind:9s} 50 x 0.1 ms alone: {train:.2f} ms (ideal 5.00)")


if __name__ == "__main__":
    main()
