"""Does a transfer kernel (NCCL's kind: it needs SMs) run beside the attention posted after it? One GPU.

Our schedules post a transfer, then the attention it should hide behind. torch's NCCL path makes NCCL's stream
wait for everything already queued on the compute stream (here attention A1), so the transfer kernel and the
next attention A2 become ready together and A2 takes every SM first (`link_delay_check.py`). If the transfer's
stream waits only for its data (ready before A1), the kernel is pending while A1 runs and may take SMs as A1's
blocks retire. A 5 ms sleep kernel stands in for the transfer (an SM kernel, like NCCL's); A1, A2 are the Flux
4096 px Ulysses-U2 attention (about 9.5 ms each on an H200). Medians of 5, ms:

- late: the transfer's stream waits for the compute stream after A1 is queued (torch's NCCL semantics);
- early: it waits for an event recorded before A1 (its data's), normal priority; early-hi: high priority.
    PYTHONPATH=$PWD python3 benchmarks/sm_race_check.py
"""
from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from streamfusion_diffusers.backends.emulated import sleep_cycles_per_second


def main() -> None:
    dev = torch.device("cuda", 0)
    q = torch.randn(1, 12, 33024, 128, device=dev, dtype=torch.bfloat16)
    rate = sleep_cycles_per_second(dev)
    streams = {"late": torch.cuda.Stream(dev), "early": torch.cuda.Stream(dev),
               "early-hi": torch.cuda.Stream(dev, priority=-1)}

    def attend() -> None:
        F.scaled_dot_product_attention(q, q, q)

    def timed(case: str, transfer_ms: float) -> float:
        main_stream, side = torch.cuda.current_stream(dev), streams[case]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(2e-3 * rate))  # the host ahead of the GPU, as in a layer
        start.record()
        data_ready = main_stream.record_event()
        attend()  # A1
        if case == "late":
            side.wait_stream(main_stream)
        else:
            side.wait_event(data_ready)
        with torch.cuda.stream(side):
            torch.cuda._sleep(int(transfer_ms * 1e-3 * rate))
        attend()  # A2
        main_stream.wait_stream(side)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    for _ in range(3):
        attend()
        for case in streams:
            timed(case, 1.0)
    a = statistics.median(timed("late", 1e-3) for _ in range(5)) / 2
    d = 5.0
    print(f"A1 = A2 = {a:.2f} ms, transfer {d:.1f} ms: overlapped {a + max(a, d):.2f}, serial {2 * a + d:.2f}")
    for case in streams:
        t = statistics.median(timed(case, d) for _ in range(5))
        print(f"{case:9s} {t:6.2f} ms  ({(t - 2 * a) / d:.0%} of the transfer exposed)")


if __name__ == "__main__":
    main()
