"""An emulated slow inter-machine link, so that one host stands in for several machines.

Wraps a real transport. Every transfer between ranks of different (virtual) machines still moves for real,
and is also booked on this rank's outgoing and incoming network queues for bytes / bandwidth + latency; the
transfer counts as done when both the real move and its booking are over. Queues are per rank, so
back-to-back transfers wait for each other as on one NIC. Transfers inside a machine are untouched.
On GPU the booking is a copy between pinned host memory and the GPU, sized to take the booked time, on the
queue's stream (`gpu_delay.py`): the copy engines hold it without an SM (a sleep kernel there would wait for the
attention filling every SM, and no transfer would ever overlap it) and without the host, so a CUDA graph replays
it too. Without cuda-bindings, or with one hardware queue, it falls back to a sleep kernel. The host never blocks.
On the CPU the booking is a deadline the handle sleeps until.
What crosses machines is also counted (`counted`), so that the cost model's volumes can be checked against it.
"""
from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.links import Link
from ..core.logs import say_once
from ..core.mesh import Group
from .base import Handle, Transport

log = logging.getLogger(__name__)


@dataclass
class Crossed:
    """Bytes and messages this rank posted across machines, and received, since the counter was made: what the
    emulated NIC booked. A replayed CUDA graph posts nothing, so only its capture counts."""

    sent_bytes: int = 0
    sent_messages: int = 0
    received_bytes: int = 0
    received_messages: int = 0

    def add(self, sent: Sequence[int], received: Sequence[int]) -> None:
        self.sent_bytes += sum(sent)
        self.sent_messages += len(sent)
        self.received_bytes += sum(received)
        self.received_messages += len(received)


class _HostQueue:
    def __init__(self) -> None:
        self.busy_until = 0.0

    def book(self, seconds: float) -> float:
        start = max(time.perf_counter(), self.busy_until)
        self.busy_until = start + seconds
        return self.busy_until


class _DeadlineHandle:
    def __init__(self, inner: Handle, deadline: float):
        self.inner, self.deadline = inner, deadline

    def wait(self) -> None:
        self.inner.wait()
        remaining = self.deadline - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)


def sleep_cycles_per_second(device: torch.device, cycles: int = 2_000_000) -> float:
    """How many `torch.cuda._sleep` cycles make a second on this GPU now (it follows the clock)."""
    with torch.cuda.device(device):
        torch.cuda._sleep(cycles // 10)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
    return cycles / (start.elapsed_time(end) * 1e-3)


@functools.cache  # a property of the GPU, measured once per process: every context books on one clock
def _job_sleep_rate(index: int) -> float:
    """The sleep rate measured once per GPU and process: every context of a job (bench and tune compare many)
    then books its link time on one scale, not on whatever the clock was at its own set-up."""
    return sleep_cycles_per_second(torch.device("cuda", index))


class _SleepQueue:
    """The fallback booking: a sleep kernel, which a kernel filling every SM delays until it ends."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self.cycles_per_s = _job_sleep_rate(device.index)

    def book(self, seconds: float) -> torch.cuda.Event:
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))  # starts no earlier than the post
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(max(1, int(seconds * self.cycles_per_s)))
        return self.stream.record_event()


class _GpuQueue:
    """One direction of this GPU's emulated NIC: bookings held by the copy engines, else sleep kernels."""

    def __init__(self, device: torch.device, to_gpu: bool):
        self.sleep: _SleepQueue | None = None
        self.nic: object | None = None
        if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
            # one hardware queue: kernels start in launch order, so a sleep posted before the attention runs
            # beside it, while a copy in that queue would hold up every stream behind it
            say_once(log, logging.INFO, "emulated link: CUDA_DEVICE_MAX_CONNECTIONS=1, bookings are sleep kernels")
            self.sleep = _SleepQueue(device)
            return
        try:
            from .gpu_delay import NicQueue
            self.nic = NicQueue(device, to_gpu)
        except Exception as err:  # no cuda-bindings, or no copy this driver takes
            say_once(log, logging.WARNING, "emulated link: no copy-engine bookings (%s); using sleep kernels, which "
                     "attention delays, so transfers that would overlap it are emulated as serial", err)
            self.sleep = _SleepQueue(device)

    def state(self) -> str:
        return self.nic.state() if self.nic is not None else "sleep kernels"

    def book(self, seconds: float) -> torch.cuda.Event:
        return self.nic.book(seconds) if self.nic is not None else self.sleep.book(seconds)


_NICS: dict[int, tuple[_GpuQueue, _GpuQueue]] = {}  # GPU index -> its NIC's queues, made once per process


def _gpu_queues(index: int) -> tuple[_GpuQueue, _GpuQueue]:
    """This process's NIC on GPU `index`, outgoing and incoming: one per rank, shared by every context of a job
    (bench and tune build many), as one machine's NIC is shared by whatever runs on it."""
    if index not in _NICS:
        device = torch.device("cuda", index)
        _NICS[index] = (_GpuQueue(device, to_gpu=True), _GpuQueue(device, to_gpu=False))
    return _NICS[index]


def nic_state() -> str:
    """This process's emulated NIC queues on GPUs as one clause ("" where none was made): a hang report says
    whether the link still holds a transfer."""
    return "; ".join(f"emulated NIC of cuda:{i}: out {out.state()}, in {into.state()}"
                     for i, (out, into) in list(_NICS.items()))


class _EventHandle:
    def __init__(self, inner: Handle, events: Sequence[torch.cuda.Event]):
        self.inner, self.events = inner, events

    def wait(self) -> None:
        self.inner.wait()
        for event in self.events:
            torch.cuda.current_stream().wait_event(event)


class EmulatedNic:
    """This rank's emulated NIC: the bytes it sends to and receives from ranks of other (virtual) machines booked
    on its two queues at `link`'s pace, and counted. Machine of a rank = rank // gpus_per_machine."""

    def __init__(self, link: Link, gpus_per_machine: int, rank: int, device: torch.device):
        self.link, self.gpus_per_machine, self.rank = link, gpus_per_machine, rank
        self.counted = Crossed()
        if device.type == "cuda":
            self._queues: tuple = _gpu_queues(device.index if device.index is not None else torch.cuda.current_device())
        else:
            self._queues = (_HostQueue(), _HostQueue())

    def remote(self, rank: int) -> bool:
        """Whether global `rank` is on another machine than this rank."""
        return rank // self.gpus_per_machine != self.rank // self.gpus_per_machine

    def delayed(self, handle: Handle, sent: Sequence[int], received: Sequence[int]) -> Handle:
        """`handle`, done once the inter-machine bytes sent and received (one entry per message) are booked through
        the two queues too."""
        self.counted.add(sent, received)
        bookings = [queue.book(self.link.seconds(sum(sizes), len(sizes)))
                    for queue, sizes in zip(self._queues, (sent, received)) if sizes]
        if not bookings:
            return handle
        if isinstance(bookings[0], float):
            return _DeadlineHandle(handle, max(bookings))
        return _EventHandle(handle, bookings)


class EmulatedTransport:
    """`inner` with inter-machine transfers slowed to `link` (its `EmulatedNic`)."""

    def __init__(self, inner: Transport, link: Link, gpus_per_machine: int, rank: int, device: torch.device):
        self.inner, self.nic = inner, EmulatedNic(link, gpus_per_machine, rank, device)
        self.name = f"{inner.name}+emulated({link.name})"
        self.counted = self.nic.counted

    def __getattr__(self, name: str):
        """Buffers and layer hooks are the real transport's; only data movement is slowed."""
        return getattr(self.inner, name)

    def _remote(self, group: Group, peer: int) -> bool:
        return self.nic.remote(group.ranks[peer])

    def _delayed(self, handle: Handle, sent: Sequence[int], received: Sequence[int]) -> Handle:
        return self.nic.delayed(handle, sent, received)

    def exchange(self, sends: Sequence[tuple[Tensor, int]], recvs: Sequence[tuple[Tensor, int]],
                 group: Group) -> Handle:
        handle = self.inner.exchange(sends, recvs, group)
        sent = [t.numel() * t.element_size() for t, peer in sends if self._remote(group, peer)]
        received = [t.numel() * t.element_size() for t, peer in recvs if self._remote(group, peer)]
        return self._delayed(handle, sent, received)

    def all_to_all(self, sends: Sequence[Sequence[Tensor]], recvs: Sequence[Sequence[Tensor]],
                   group: Group) -> Handle:
        handle = self.inner.all_to_all(sends, recvs, group)
        sent, received = ([t.numel() * t.element_size() for peer, ts in enumerate(pieces) if self._remote(group, peer)
                           for t in ts if t.numel()] for pieces in (sends, recvs))
        return self._delayed(handle, sent, received)

    def all_gather(self, output: Tensor, input: Tensor, group: Group) -> Handle:
        handle = self.inner.all_gather(output, input, group)
        nbytes = input.numel() * input.element_size()
        remote = [nbytes for peer in range(group.size) if self._remote(group, peer)]
        return self._delayed(handle, remote, remote)
