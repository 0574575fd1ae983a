"""One-sided transport over NVSHMEM (paper Section 4.4 and Appendix A), for the same schedules as NCCL.

Every transfer is a SCATTERPUSH: `putmem_signal_on_stream` of the sender's chunk straight into the
receiver's mailbox (nvshmem_pool.py), which sets a signal word when the bytes have landed. The receiver's
`Handle.wait()` puts `signal_wait_until_on_stream` on its compute stream: the host never blocks, and no
transfer needs a barrier or a handshake. The paper pulls Q and K, V instead (GATHERPULL), which needs the
peer's chunk to be ready, hence its BARRIER over the ring group before every Pull KV stage; a signalled push
is ready by construction, so one BARRIERALL per layer is left: at `begin_layer`, on the side stream, so
that no PE writes into a mailbox its owner still reads from the previous layer. It never stalls compute.

Streams, as Appendix A: the ring group's transfers run on `stream_ring`, all others on `stream_other`, both
beside the compute stream (whatever stream is current). `begin_layer` forks them from the compute stream
and `end_layer` joins them back, so one layer can be captured in a CUDA graph.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
from torch import Tensor

from ..core.mesh import Group
from .base import Handle
from .nvshmem_pool import Mailbox
from .nvshmem_runtime import Runtime, current, finalize, start

class Arrival:
    """Handle of one-sided receives: the compute stream waits for each buffer's signal, then `then` runs."""

    def __init__(self, transport: NvshmemTransport, signals: list[int], then: Sequence[tuple[Tensor, Tensor]] = ()):
        self.transport, self.signals, self.then = transport, signals, list(then)
        transport._unwaited.update(signals)

    def wait(self) -> None:
        self.transport._wait_signals(self.signals)
        for dst, src in self.then:
            dst.copy_(src)
        self.signals, self.then = [], []


class NvshmemTransport:
    """Transport with SCATTERPUSH / BARRIERALL on two side streams; one per process (NVSHMEM is per process)."""

    name = kind = "nvshmem"

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.bindings = runtime.bindings
        self._signal_set = int(self.bindings.Signal_op.SIGNAL_SET)
        self._cmp_ge = int(self.bindings.Cmp_type.CMP_GE)
        self.mailbox = Mailbox(runtime)
        self.stream_ring = torch.cuda.Stream(runtime.device)
        self.stream_other = torch.cuda.Stream(runtime.device)
        self._signal_of: dict[int, int] = {}  # receive buffer address -> its signal address, this layer
        self._unwaited: set[int] = set()  # signals posted by a handle that nobody waited on yet
        self._held: list[Tensor] = []  # sources of puts in flight, kept alive until end_layer joins the streams

    # --- the paper's primitives ----------------------------------------------------------------------------
    def barrier_all(self, stream: torch.cuda.Stream) -> None:
        """BARRIERALL on `stream`: later work on it starts once every PE has reached this point."""
        self.bindings.barrier_all_on_stream(stream.cuda_stream)

    def scatter_push(self, sends: Sequence[tuple[Tensor, int]], stream: torch.cuda.Stream) -> None:
        """SCATTERPUSH: put each tensor into its PE's mailbox on `stream`, after the compute queued so far."""
        sources = [(t.contiguous(), pe) for t, pe in sends if t.numel()]
        if not sources:
            return
        stream.wait_stream(torch.cuda.current_stream(self.runtime.device))
        for src, pe in sources:
            nbytes = src.numel() * src.element_size()
            dest, signal = self.mailbox.outgoing(pe, nbytes)
            self.bindings.putmem_signal_on_stream(dest, src.data_ptr(), nbytes, signal, 1, self._signal_set, pe,
                                                  stream.cuda_stream)
            self._held.append(src)

    # --- Transport -------------------------------------------------------------------------------------------
    def begin_layer(self, peer_bytes: int) -> None:
        self.mailbox.reserve(peer_bytes)
        self.mailbox.reset()
        compute = torch.cuda.current_stream(self.runtime.device)
        self.stream_other.wait_stream(compute)
        self.barrier_all(self.stream_other)  # every PE has finished reading the previous layer's mailbox
        self.stream_ring.wait_stream(self.stream_other)

    def end_layer(self) -> None:
        compute = torch.cuda.current_stream(self.runtime.device)
        self._wait_signals(list(self._unwaited))  # a handle nobody waited on still owns mailbox bytes
        compute.wait_stream(self.stream_ring)
        compute.wait_stream(self.stream_other)
        self.mailbox.signals.zero_()  # every signal of this layer was consumed; the next begin_layer fences it
        self._held.clear()
        self._signal_of.clear()

    def recv_buffer(self, like: Tensor, shape: Sequence[int], peer: int, group: Group) -> Tensor:
        if math.prod(shape) == 0:
            return like.new_empty(tuple(shape))
        view, signal = self.mailbox.incoming(group.ranks[peer], like.dtype, shape)
        self._signal_of[view.data_ptr()] = signal
        return view

    def staging(self, group: Group, like: Tensor, shape: Sequence[int]) -> Tensor | None:
        """Puts read from any buffer: nothing to pack into."""
        return None

    def exchange(self, sends: Sequence[tuple[Tensor, int]], recvs: Sequence[tuple[Tensor, int]],
                 group: Group) -> Handle:
        if any(peer == group.index for _, peer in sends):
            raise ValueError("a rank does not send to itself; copy locally instead")
        stream = self.stream_ring if group.name == "ring" else self.stream_other
        self.scatter_push([(t, group.ranks[peer]) for t, peer in sends], stream)
        return Arrival(self, self._signals([buf for buf, _ in recvs]))

    def all_to_all(self, sends: Sequence[Sequence[Tensor]], recvs: Sequence[Sequence[Tensor]],
                   group: Group) -> Handle:
        me = group.index
        pieces = [(view, self.recv_buffer(view, view.shape, j, group)) for j in range(group.size) if j != me
                  for view in recvs[j] if view.numel()]  # mailbox slots in the order the peer pushes them
        self.scatter_push([(t, group.ranks[j]) for j in range(group.size) if j != me for t in sends[j]],
                          self.stream_other)
        for src, dst in zip(sends[me], recvs[me], strict=True):
            dst.copy_(src)
        return Arrival(self, self._signals(buf for _, buf in pieces), [(view, buf) for view, buf in pieces])

    def all_gather(self, output: Tensor, input: Tensor, group: Group) -> Handle:
        me = group.index
        views = {j: self.recv_buffer(input, input.shape, j, group) for j in range(group.size) if j != me}
        self.scatter_push([(input, group.ranks[j]) for j in views], self.stream_other)
        output[me].copy_(input)
        return Arrival(self, self._signals(views.values()), [(output[j], v) for j, v in views.items()])

    # --- bookkeeping -----------------------------------------------------------------------------------------
    def _signals(self, buffers: Iterable[Tensor]) -> list[int]:
        try:
            return [self._signal_of.pop(buf.data_ptr()) for buf in buffers if buf.numel()]
        except KeyError:
            raise ValueError("receive buffers of the nvshmem transport must come from its recv_buffer, in this "
                             "layer (between begin_layer and end_layer)") from None

    def _wait_signals(self, signals: Sequence[int]) -> None:
        stream = torch.cuda.current_stream(self.runtime.device).cuda_stream
        for signal in signals:
            if signal in self._unwaited:
                self.bindings.signal_wait_until_on_stream(signal, self._cmp_ge, 1, stream)
                self._unwaited.discard(signal)


def nvshmem_transport(timeout_s: float) -> NvshmemTransport:
    """The NVSHMEM runtime's transport, starting NVSHMEM on first use (collective; may raise
    NvshmemUnavailable). Every ParallelContext shares it, and so one mailbox in the one symmetric heap."""
    runtime = start(timeout_s)
    if runtime.transport is None:
        runtime.transport = NvshmemTransport(runtime)
    return runtime.transport


def close() -> None:
    """Free the transport's symmetric memory and finalize NVSHMEM (collective; a no-op where it never ran)."""
    runtime = current()
    if runtime is not None and runtime.transport is not None:
        runtime.transport.mailbox.free()
        runtime.transport = None
    finalize()
