"""The torch transport with all-to-alls that take no SM: pulled by the copy engines from symmetric memory.

NCCL runs an all-to-all as kernels. Beside a GEMM that fills every SM (a Flux single block's proj_mlp, the
projections of the next head group) those kernels start only when the GEMM ends, so an exchange "overlapped"
with it waits all the same (BENCHMARKS.md, "the all-to-all beside a GEMM"). Here an all-to-all of even pieces
(Ulysses' packed buffers) goes another way:

- the rank copies its packed send buffer into a buffer of symmetric memory (torch's `_symmetric_memory`: every
  peer of the group can address it);
- it raises one flag in every peer's signal pad ("my data is ready");
- on one side stream per peer, it waits for that peer's flag, lowers it, pulls its own piece out of the peer's
  buffer with `cuMemcpyDtoDAsync` (a copy engine, no SM) and raises a flag in the peer's pad ("read");
- `wait()` makes the current stream wait for the pulls; the next exchange that writes the same buffer first waits
  for every peer's "read" flag.

The flags are stream memory operations (`cuStreamWriteValue32`, `cuStreamWaitValue32`), run by the GPU's front
end, not by an SM. Their values are constant (raised to 1, lowered to 0 by whoever waited for them), so a CUDA
graph that captured an exchange replays it. Each (group, size) has two buffers used in turn, so that two
exchanges of one size may be in flight (a pipeline's in(g) and in(g + 1)).

Everything else (send / recv pairs, uneven all-to-alls, all-gathers, the CPU) is the torch transport's.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..core.mesh import Group
from .base import Handle
from .cuda_driver import check, driver
from .torch_dist import _ASYNC, TorchTransport, _end_to_end

SLOTS = 2  # buffers per (group, size), used in turn


@dataclass
class _Slot:
    """One symmetric buffer of a group and its flags: pad[j] is raised by peer j when its data is ready,
    pad[size + j] when peer j has read this rank's piece."""

    buffer: Tensor
    buffers: list[int]  # every member's buffer address, as this rank addresses it
    pads: list[int]  # every member's signal pad address
    busy: bool = False  # posted and not yet waited on: its buffer may not be written
    used: bool = False  # posted before: its peers raise "read" flags, lowered before the buffer is written again


class CopyEngineTransport(TorchTransport):
    """TorchTransport whose even all-to-alls on GPUs are pulled by the copy engines (the module docstring)."""

    name = "torch+copy-engine"

    def __init__(self) -> None:
        super().__init__()
        self._driver = driver()
        self._slots: dict[tuple[str, int], list[_Slot]] = {}
        self._turn: dict[tuple[str, int], int] = {}
        self._side: torch.cuda.Stream | None = None
        # one stream per peer position, shared by every buffer: few streams, so few share a hardware queue with
        # the compute stream (a stream waiting on a flag holds up what its hardware queue holds behind it)
        self._pulls: list[torch.cuda.Stream] = []

    def all_to_all(self, sends: Sequence[Sequence[Tensor]], recvs: Sequence[Sequence[Tensor]],
                   group: Group) -> Handle:
        packed = _end_to_end(sends) if group.size > 1 else None
        unpacked = _end_to_end(recvs) if packed is not None else None
        if unpacked is None or unpacked[0].dtype != packed[0].dtype:
            return self._by_pieces(sends, recvs, group)
        slot = self._slot(group, packed[0]) if packed[0].is_cuda and _even(packed[1], unpacked[1]) else None
        if slot is None:  # uneven, on the CPU, or a new size inside a CUDA-graph capture (no buffer made there)
            return group.pg.alltoall_base(unpacked[0], packed[0], unpacked[1], packed[1], _ASYNC)
        return self._pull(packed[0], unpacked[0], group, slot)

    def _pull(self, send: Tensor, recv: Tensor, group: Group, slot: _Slot) -> Handle:
        me, size, drv = group.index, group.size, self._driver
        slot.busy = True
        current = torch.cuda.current_stream(send.device)
        if slot.used:  # every peer has read what the buffer held before (lowered here, not at wait(), so that
            for j in range(size):  # the compute stream waits for the peers' pulls only when it must)
                self._lower(current, slot.pads[me] + 4 * (size + j))
        slot.used = True
        slot.buffer.view(-1).view(send.dtype)[:send.numel()].copy_(send)  # on the current stream
        side = self._side_stream(send.device)
        side.wait_stream(current)
        for j in range(size):  # my piece for every peer is in my buffer
            self._raise(side, slot.pads[j] + 4 * me)
        posted = side.record_event()
        chunk = recv.nbytes // size
        pulls = self._pull_streams(size, send.device)
        for j, stream in enumerate(pulls):
            stream.wait_event(posted)
            self._lower(stream, slot.pads[me] + 4 * j)  # peer j's data is ready
            check(drv.cuMemcpyDtoDAsync(drv.CUdeviceptr(recv.data_ptr() + j * chunk),
                                        drv.CUdeviceptr(slot.buffers[j] + me * chunk), chunk,
                                        drv.CUstream(stream.cuda_stream)))
            self._raise(stream, slot.pads[j] + 4 * (size + me))  # I have read peer j's piece
        return _Pulled(slot, [stream.record_event() for stream in pulls])

    def _slot(self, group: Group, send: Tensor) -> _Slot | None:
        """The next of the group's buffers for this size, made (collectively) at its first use; None where it
        would have to be made inside a CUDA-graph capture."""
        key = (group.pg.group_name, send.nbytes)
        slots = self._slots.setdefault(key, [])
        turn = self._turn.get(key, 0)
        if turn == len(slots):
            if torch.cuda.is_current_stream_capturing():
                return None
            slots.append(self._make_slot(group, send))
        if slots[turn].busy:
            raise RuntimeError(f"more than {SLOTS} all-to-alls of {send.nbytes} bytes in flight on one group: wait "
                               f"on one before posting another")
        self._turn[key] = (turn + 1) % SLOTS
        return slots[turn]

    def _make_slot(self, group: Group, send: Tensor) -> _Slot:
        import torch.distributed._symmetric_memory as symm_mem

        if (enable := getattr(symm_mem, "enable_symm_mem_for_group", None)) is not None:
            enable(group.pg.group_name)  # torch before 2.9 asks for it on groups other than the world
        buffer = symm_mem.empty(send.nbytes, dtype=torch.uint8, device=send.device)
        handle = symm_mem.rendezvous(buffer, group.pg.group_name)
        handle.get_signal_pad(group.index, (2 * group.size,), dtype=torch.int32).zero_()
        torch.cuda.synchronize(send.device)
        dist.barrier(group=group.pg)  # every pad zeroed before anyone raises a flag in it
        return _Slot(buffer, [handle.buffer_ptrs[j] for j in range(group.size)],
                     [handle.signal_pad_ptrs[j] for j in range(group.size)])

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._side is None:
            self._side = torch.cuda.Stream(device)
        return self._side

    def _pull_streams(self, size: int, device: torch.device) -> list[torch.cuda.Stream]:
        while len(self._pulls) < size:
            self._pulls.append(torch.cuda.Stream(device))
        return self._pulls[:size]

    def _raise(self, stream: torch.cuda.Stream, address: int) -> None:
        drv = self._driver
        check(drv.cuStreamWriteValue32(drv.CUstream(stream.cuda_stream), drv.CUdeviceptr(address), 1, 0))

    def _lower(self, stream: torch.cuda.Stream, address: int) -> None:
        """Wait until the flag is raised, then lower it: it is raised again only after what follows here."""
        drv = self._driver
        flags = drv.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ
        check(drv.cuStreamWaitValue32(drv.CUstream(stream.cuda_stream), drv.CUdeviceptr(address), 1, flags))
        check(drv.cuStreamWriteValue32(drv.CUstream(stream.cuda_stream), drv.CUdeviceptr(address), 0, 0))


class _Pulled:
    """Handle of a pulled all-to-all: the current stream waits for its pulls (events: a later exchange's pulls on
    the same streams are not waited for)."""

    def __init__(self, slot: _Slot, pulled: list[torch.cuda.Event]):
        self.slot, self.pulled = slot, pulled

    def wait(self) -> None:
        if self.slot is None:
            return
        current = torch.cuda.current_stream(self.slot.buffer.device)
        for event in self.pulled:
            current.wait_event(event)
        self.slot.busy = False
        self.slot = None


def _even(sent: Sequence[int], received: Sequence[int]) -> bool:
    """Every piece of the same size each way: then a peer's piece for this rank lies at this rank's position."""
    return len(set(sent)) == 1 and list(sent) == list(received)


__all__ = ["CopyEngineTransport"]
