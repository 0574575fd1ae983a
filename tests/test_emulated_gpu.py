"""The emulated link's bookings on a GPU behave like a NIC's transfers: they overlap an attention kernel that
fills every SM (a sleep kernel cannot: it waits for the attention to end), bookings on one queue run one after
another, a host blocked on the GPU with bookings pending goes on, and a CUDA graph replays a booking's time. One
GPU; needs cuda-bindings (it comes with CUDA torch wheels)."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(importlib.util.find_spec("cuda") is None, reason="needs cuda-bindings"),
              pytest.mark.skipif(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1",
                                 reason="one hardware queue: the emulated link books with sleep kernels")]


def _ms(run) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # the host ahead of the GPU, as in a layer
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _attention():
    q = torch.randn(1, 24, 16384, 128, device="cuda", dtype=torch.bfloat16)
    return lambda: F.scaled_dot_product_attention(q, q, q)


def test_a_booking_overlaps_attention_that_fills_every_sm():
    from streamfusion_diffusers.backends.emulated import _gpu_queues

    send, _ = _gpu_queues(torch.cuda.current_device())
    assert send.nic is not None, "copy-engine bookings unavailable: the emulated link would serialize transfers"
    attend = _attention()
    attend()
    attention_ms = min(_ms(attend) for _ in range(3))
    seconds = 2 * attention_ms * 1e-3

    def booked_beside_attention():
        event = send.book(seconds)
        attend()
        torch.cuda.current_stream().wait_event(event)

    both = min(_ms(booked_beside_attention) for _ in range(3))
    # overlapped: max(A, D) = D; serial (a sleep kernel behind the attention) would be A + D = 1.5 D
    assert both < 1.15 * seconds * 1e3, (both, attention_ms)
    assert both > 0.97 * seconds * 1e3, (both, attention_ms)


def test_bookings_on_one_queue_run_one_after_another():
    from streamfusion_diffusers.backends.emulated import _gpu_queues

    _, receive = _gpu_queues(torch.cuda.current_device())

    def three():
        events = [receive.book(5e-3) for _ in range(3)]
        torch.cuda.current_stream().wait_event(events[-1])

    total = min(_ms(three) for _ in range(3))
    assert 14.5 < total < 16.5, total


_BLOCKED = """
import torch
from streamfusion_diffusers.backends.emulated import _gpu_queues
send, receive = _gpu_queues(torch.cuda.current_device())
x = torch.randn(4096, 4096, device="cuda")
for _ in range({rounds}):
    for queue in (send, receive):
        torch.cuda.current_stream().wait_event(queue.book(2e-3))
    x = x @ x.t() / 4096  # kernels between bookings, as layers put them
print("item", float(x.float().norm().item()))  # the host blocks here until the GPU is done
"""


def test_a_host_blocked_on_the_gpu_with_bookings_pending_finishes():
    """A rank's host that blocks in a GPU wait (`.item()`) while its link still holds bookings: the emulated step
    over 2 x 2 stopped in this state when a host thread released the bookings (BENCHMARKS.md)."""
    import subprocess
    import sys

    try:
        done = subprocess.run([sys.executable, "-c", _BLOCKED.format(rounds=12)], capture_output=True, text=True,
                              timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the host's .item() did not return within 60 s with bookings pending")
    assert done.returncode == 0 and "item" in done.stdout, done.stderr[-2000:]


def test_a_cuda_graph_replays_a_bookings_time():
    """Step-level graphs over an emulated link: a booking captured with the attention beside it holds its time
    at every replay, as eagerly."""
    from streamfusion_diffusers.backends.emulated import _gpu_queues
    from streamfusion_diffusers.diffusers.graphs import capture

    send, _ = _gpu_queues(torch.cuda.current_device())
    attend = _attention()
    attend()
    seconds = 2 * min(_ms(attend) for _ in range(3)) * 1e-3

    def booked_beside_attention():
        event = send.book(seconds)
        out = attend()
        torch.cuda.current_stream().wait_event(event)
        return out

    eager = min(_ms(booked_beside_attention) for _ in range(3))
    graph, _ = capture(booked_beside_attention)
    replayed = min(_ms(graph.replay) for _ in range(3))
    assert 0.97 * seconds * 1e3 < replayed < 1.15 * seconds * 1e3, (replayed, eager)
    assert abs(replayed - eager) < 0.1 * eager, (replayed, eager)
