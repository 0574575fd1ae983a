"""The torch transport with Ulysses' all-to-alls as one kernel of peer loads from symmetric memory.

NCCL's all-to-all moves a Flux step's packed Q/K/V well below what NVLink carries (BENCHMARKS.md), and a step at
the sizes images are served at has over a hundred of them. Here an even all-to-all (every
piece one size, Ulysses' packed buffers) goes another way, on GPUs:

- the rank's packed sends lie in a buffer of symmetric memory (torch's `_symmetric_memory`: every member of the
  group can address it): Ulysses packs them there (`staging`), else they are copied in, on the current stream;
- on a side stream: a device barrier (every member's buffer holds its data), then one Triton kernel loads this
  rank's piece out of every member's buffer over NVLink and stores it where the caller wants it: the pieces may
  be strided views of the caller's result (runs of one length a uniform stride apart), so Ulysses receives its
  rows and heads in their final layout, with no copy after the exchange; then a second barrier (every member has
  read this rank's buffer);
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
def pull_pieces(ptrs, out, me, piece, block, stride, member_stride, BLOCK: tl.constexpr):
    """Program (k, i, j): words [i BLOCK, (i + 1) BLOCK) of run k of this rank's piece in member j's buffer
    (`ptrs[j]`; pieces of `piece` int32 words end to end, each runs of `block` words) into `out` at
    j member_stride + k stride. Runs are the grid's first axis, the one without a 65535 limit."""
    k, i, member = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    src = tl.load(ptrs + member).to(tl.pointer_type(tl.int32))
    offs = i * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block
    words = tl.load(src + me * piece + k * block + offs, mask=mask)
    tl.store(out + member * member_stride + k * stride + offs, words, mask=mask)


@dataclass(frozen=True)
class Target:
    """Where the pieces land, in int32 words from `out`'s first one: piece j's run k at j member_stride +
    k stride, `runs` runs of `block` words a piece."""

    out: Tensor  # int32, its first word the first piece's
    runs: int
    block: int
    stride: int
    member_stride: int


def pull(ptrs: Tensor, target: Target, me: int, members: int) -> None:
    """Piece `me` of every member's buffer (`ptrs`) into `target`, piece j from member j."""
    per_program = min(BLOCK_BYTES // 4, triton.next_power_of_2(target.block))
    grid = (target.runs, triton.cdiv(target.block, per_program), members)
    pull_pieces[grid](ptrs, target.out, me, target.runs * target.block, target.block, target.stride,
                      target.member_stride, BLOCK=per_program)


def target_of(recvs: Sequence[Tensor], piece_bytes: int) -> Target | None:
    """The pieces as a Target where the pull can write them in place: each `piece_bytes` long, one dtype, runs
    of one length a uniform stride apart, every piece as the first one shifted by a uniform stride (the first
    lowest), all in whole aligned words, none empty; else None."""
    first = recvs[0]
    runs = _runs(first)
    size = first.element_size()
    if runs is None or not piece_bytes or first.numel() * size != piece_bytes or first.data_ptr() % 4:
        return None
    count, block, stride = runs
    shift = (recvs[1].data_ptr() - first.data_ptr()) // size if len(recvs) > 1 else 0
    for j, piece in enumerate(recvs):
        if piece.dtype != first.dtype or piece.shape != first.shape or piece.stride() != first.stride() \
                or piece.data_ptr() - first.data_ptr() != j * shift * size:
            return None
    if shift < 0 or (block * size) % 4 or (stride * size) % 4 or (shift * size) % 4:
        return None
    return Target(_words_from(first), count, block * size // 4, stride * size // 4, shift * size // 4)


def _words_from(t: Tensor) -> Tensor:
    """t's storage as int32 words from t's first byte to the storage's end (the kernel takes its address)."""
    storage = t.untyped_storage()
    offset = (t.data_ptr() - storage.data_ptr()) // 4
    words = torch.empty(0, dtype=torch.int32, device=t.device)
    return words.set_(storage, offset, (storage.nbytes() // 4 - offset,), (1,))


def _runs(t: Tensor) -> tuple[int, int, int] | None:
    """(count, length, stride) in elements where `t`, in its own order, is `count` contiguous runs of `length`
    elements `stride` apart; else None."""
    dims = [(n, s) for n, s in zip(t.shape, t.stride()) if n != 1]
    length = 1
    while dims and dims[-1][1] == length:
        length *= dims.pop()[0]
    if not dims:
        return 1, length, 0
    for (_, outer), (n, inner) in zip(dims, dims[1:]):
        if outer != inner * n:
            return None
    return math.prod(n for n, _ in dims), length, dims[-1][1]


@dataclass
class _Slot:
    """One symmetric buffer of a group, its members' addresses and the event after its last readers."""

    buffer: Tensor
    handle: object  # torch's symmetric-memory handle: the barriers
    ptrs: Tensor  # every member's buffer address, as this rank addresses it (int64, on the GPU)
    read: torch.cuda.Event | None = None  # every member has read it (eagerly): it may be written again


class SymmPullTransport(TorchTransport):
    """TorchTransport whose even all-to-alls on GPUs are one kernel of peer loads (the module docstring)."""

    name, kind = "torch+symm-pull", "symm-pull"

    def __init__(self) -> None:
        super().__init__()
        self._slots: dict[tuple[str, int], list[_Slot]] = {}
        self._turn: dict[tuple[str, int], int] = {}
        self._staged: dict[int, _Slot] = {}  # buffer address -> its slot, handed out by `staging`
        self._side: torch.cuda.Stream | None = None
        self._pulled = False  # this layer posted a pull

    def end_layer(self) -> None:
        """Every pull of the layer is over before later work on the current stream, also where an error left
        its handle unwaited (its receive buffer may go back to the allocator)."""
        if self._pulled:
            torch.cuda.current_stream(self._side.device).wait_stream(self._side)
            self._pulled = False

    def staging(self, group: Group, like: Tensor, shape: Sequence[int]) -> Tensor | None:
        """The buffer the next exchange of this size is pulled from (its slot taken now), once every member has
        read what it held; None off GPUs, inside a capture that would make it, or for sizes not whole words."""
        nbytes = math.prod(shape) * like.element_size()
        if group.size == 1 or not like.is_cuda or nbytes % 4:
            return None
        slot = self._slot(group, nbytes, like.device)
        if slot is None:
            return None
        _after_readers(slot, like.device)
        self._staged[slot.buffer.data_ptr()] = slot
        return slot.buffer[:nbytes].view(like.dtype).view(tuple(shape))

    def all_to_all(self, sends: Sequence[Sequence[Tensor]], recvs: Sequence[Sequence[Tensor]],
                   group: Group) -> Handle:
        packed = _end_to_end(sends) if group.size > 1 else None
        staged = self._staged.pop(packed[0].data_ptr(), None) if packed is not None else None
        target = slot = None
        if packed is not None and packed[0].is_cuda and len(set(packed[1])) == 1 and packed[0].data_ptr() % 4 == 0 \
                and all(len(pieces) == 1 and pieces[0].dtype == packed[0].dtype for pieces in recvs):
            target = target_of([pieces[0] for pieces in recvs], packed[1][0] * packed[0].element_size())
        if target is not None:
            slot = staged or self._slot(group, packed[0].nbytes, packed[0].device)
        if slot is None:  # uneven, not in place, on the CPU, or a new size inside a capture (no buffer made there);
            return super().all_to_all(sends, recvs, group)  # NCCL reads a staged buffer before wait() returns
        return self._pull(packed[0], target, group, slot)

    def _pull(self, send: Tensor, target: Target, group: Group, slot: _Slot) -> Handle:
        current = torch.cuda.current_stream(send.device)
        if send.data_ptr() != slot.buffer.data_ptr():  # not packed in place (staging)
            _after_readers(slot, send.device)
            slot.buffer[:send.nbytes].copy_(send.reshape(-1).view(torch.uint8))
        side = self._side_stream(send.device)
        side.wait_stream(current)
        self._pulled = True
        with torch.cuda.stream(side):
            slot.handle.barrier(channel=0)  # every member's piece for every other is in its buffer
            pull(slot.ptrs, target, group.index, group.size)
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


def _after_readers(slot: _Slot, device: torch.device) -> None:
    """The current stream waits until the members' last pulls out of the slot's buffer are over. Not inside a
    capture, which cannot wait on an event recorded outside it: a capture starts synchronized, and inside it
    each exchange's handle is waited on before its buffer's next turn."""
    if slot.read is not None and not torch.cuda.is_current_stream_capturing():
        torch.cuda.current_stream(device).wait_event(slot.read)


class _Pulled:
    """Handle of a pulled all-to-all: the current stream waits for its pull."""

    def __init__(self, pulled: torch.cuda.Event):
        self.pulled: torch.cuda.Event | None = pulled

    def wait(self) -> None:
        if self.pulled is not None:
            torch.cuda.current_stream().wait_event(self.pulled)
            self.pulled = None


__all__ = ["SymmPullTransport", "Target", "pull", "target_of"]
