"""The torch transport with Ulysses' all-to-alls as one kernel of peer loads from symmetric memory.

NCCL's all-to-all moves a Flux step's packed Q/K/V at about half of what NVLink carries (BENCHMARKS.md, session
43), and a step at the sizes images are served at has over a hundred of them. Here an even all-to-all (every
piece one size, Ulysses' packed buffers) goes another way, on GPUs:

- the rank's packed sends lie in a buffer of symmetric memory (torch's `_symmetric_memory`: every member of the
  group can address it): Ulysses packs them there (`staging`), else they are copied in, on the current stream;
- on a side stream: a device barrier (every member's buffer holds its data), then one Triton kernel loads this
  rank's piece out of every member's buffer over NVLink into the receive buffer, then a second barrier (every
  member has read this rank's buffer);
- `wait()` makes the current stream wait for the pull; the next exchange that writes the same buffer first waits
  for the second barrier.

Barriers and kernel replay in CUDA graphs. Each (group, size) has two buffers used in turn, so that two
exchanges of one size may be in flight. Everything else (send / recv pairs, uneven all-to-alls, all-gathers, the
CPU) is the torch transport's.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import triton
import triton.language as tl
from torch import Tensor

from ..core.mesh import Group
from .base import Handle
from .torch_dist import TorchTransport, _end_to_end

SLOTS = 2  # buffers per (group, size), used in turn
BLOCK_BYTES = 16384  # bytes one program moves


@triton.jit
def pull_pieces(ptrs, out, me, piece, BLOCK: tl.constexpr):
    """Program (i, j): block i of this rank's piece in member j's buffer (`ptrs[j]`, `piece` int32 words each)
    into slot j of `out`."""
    i, member = tl.program_id(0), tl.program_id(1)
    src = tl.load(ptrs + member).to(tl.pointer_type(tl.int32))
    offs = i * BLOCK + tl.arange(0, BLOCK)
    mask = offs < piece
    tl.store(out + member * piece + offs, tl.load(src + me * piece + offs, mask=mask), mask=mask)


def pull(ptrs: Tensor, out: Tensor, me: int, members: int) -> None:
    """`out` (members pieces end to end, a whole number of 4-byte words each): piece j from member j's buffer."""
    words = out.view(torch.int32)
    piece = words.numel() // members
    block = BLOCK_BYTES // 4
    pull_pieces[(triton.cdiv(piece, block), members)](ptrs, words, me, piece, BLOCK=block)


@dataclass
class _Slot:
    """One symmetric buffer of a group, its members' addresses and the event after its last readers."""

    buffer: Tensor
    handle: object  # torch's symmetric-memory handle: the barriers
    ptrs: Tensor  # every member's buffer address, as this rank addresses it (int64, on the GPU)
    read: torch.cuda.Event | None = None  # every member has read it (eagerly): it may be written again


class SymmPullTransport(TorchTransport):
    """TorchTransport whose even all-to-alls on GPUs are one kernel of peer loads (the module docstring)."""

    name = "torch+symm-pull"

    def __init__(self) -> None:
        super().__init__()
        self._slots: dict[tuple[str, int], list[_Slot]] = {}
        self._turn: dict[tuple[str, int], int] = {}
        self._staged: dict[int, _Slot] = {}  # buffer address -> its slot, handed out by `staging`
        self._side: torch.cuda.Stream | None = None

    def staging(self, group: Group, like: Tensor, shape: Sequence[int]) -> Tensor | None:
        """The buffer the next exchange of this size is pulled from (its slot taken now), once every member has
        read what it held; None off GPUs, inside a capture that would make it, or for sizes not whole words."""
        nbytes = math.prod(shape) * like.element_size()
        if group.size == 1 or not like.is_cuda or nbytes % 4:
            return None
        slot = self._slot(group, nbytes, like.device)
        if slot is None:
            return None
        if slot.read is not None:
            torch.cuda.current_stream(like.device).wait_event(slot.read)
        self._staged[slot.buffer.data_ptr()] = slot
        return slot.buffer[:nbytes].view(like.dtype).view(tuple(shape))

    def all_to_all(self, sends: Sequence[Sequence[Tensor]], recvs: Sequence[Sequence[Tensor]],
                   group: Group) -> Handle:
        packed = _end_to_end(sends) if group.size > 1 else None
        unpacked = _end_to_end(recvs) if packed is not None else None
        slot = self._staged.pop(packed[0].data_ptr(), None) if packed is not None else None
        if slot is None and packed is not None and unpacked is not None and packed[0].is_cuda and \
                _even(packed, unpacked):
            slot = self._slot(group, packed[0].nbytes, packed[0].device)
        elif slot is not None and (unpacked is None or not _even(packed, unpacked)):
            slot = None  # staged, but not an exchange it can pull: NCCL sends from the buffer (read after wait)
        if slot is None:  # uneven, on the CPU, or a new size inside a CUDA-graph capture (no buffer made there)
            return super().all_to_all(sends, recvs, group)
        return self._pull(packed[0], unpacked[0], group, slot)

    def _pull(self, send: Tensor, recv: Tensor, group: Group, slot: _Slot) -> Handle:
        current = torch.cuda.current_stream(send.device)
        if send.data_ptr() != slot.buffer.data_ptr():  # not packed in place (staging)
            if slot.read is not None:
                current.wait_event(slot.read)  # the members' last pulls out of this buffer are over
            slot.buffer[:send.nbytes].copy_(send.reshape(-1).view(torch.uint8))
        side = self._side_stream(send.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            slot.handle.barrier(channel=0)  # every member's piece for every other is in its buffer
            pull(slot.ptrs, recv.reshape(-1).view(torch.uint8), group.index, group.size)
            slot.handle.barrier(channel=1)  # every member has read this rank's buffer
        read = side.record_event()
        # an event recorded inside a CUDA-graph capture cannot be waited on outside it; the graph's own waits
        # (its handles') order its exchanges
        slot.read = None if torch.cuda.is_current_stream_capturing() else read
        return _Pulled(read)

    def _slot(self, group: Group, nbytes: int, device: torch.device) -> _Slot | None:
        """The next of the group's buffers of `nbytes`, made (collectively) at its first use; None where it would
        have to be made inside a CUDA-graph capture."""
        key = (group.pg.group_name, nbytes)
        slots = self._slots.setdefault(key, [])
        turn = self._turn.get(key, 0)
        if turn == len(slots):
            if torch.cuda.is_current_stream_capturing():
                return None
            slots.append(self._make_slot(group, nbytes, device))
        self._turn[key] = (turn + 1) % SLOTS
        return slots[turn]

    def _make_slot(self, group: Group, nbytes: int, device: torch.device) -> _Slot:
        import torch.distributed._symmetric_memory as symm_mem

        if (enable := getattr(symm_mem, "enable_symm_mem_for_group", None)) is not None:
            enable(group.pg.group_name)  # torch before 2.9 asks for it on groups other than the world
        buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(buffer, group.pg.group_name)
        ptrs = torch.tensor([handle.buffer_ptrs[j] for j in range(group.size)], dtype=torch.int64, device=device)
        torch.cuda.synchronize(device)
        dist.barrier(group=group.pg)
        return _Slot(buffer, handle, ptrs)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if self._side is None:
            self._side = torch.cuda.Stream(device)
        return self._side


class _Pulled:
    """Handle of a pulled all-to-all: the current stream waits for its pull."""

    def __init__(self, pulled: torch.cuda.Event):
        self.pulled: torch.cuda.Event | None = pulled

    def wait(self) -> None:
        if self.pulled is not None:
            torch.cuda.current_stream().wait_event(self.pulled)
            self.pulled = None


def _even(packed: tuple[Tensor, list[int]], unpacked: tuple[Tensor, list[int]]) -> bool:
    """One dtype, every piece of one size each way (then a member's piece for this rank lies at this rank's
    position in its buffer), a whole number of 4-byte words a piece, at 4-byte aligned addresses."""
    (send, sent), (recv, received) = packed, unpacked
    return (send.dtype == recv.dtype and len(set(sent)) == 1 and list(sent) == list(received)
            and sent[0] * send.element_size() % 4 == 0 and send.data_ptr() % 4 == 0 and recv.data_ptr() % 4 == 0)


__all__ = ["SymmPullTransport", "pull"]
