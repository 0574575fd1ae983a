"""Two-sided transport over torch.distributed: NCCL on GPUs, gloo on the CPU.

Every transfer is posted with async_op=True; NCCL runs it on its own stream, so attention queued on the
compute stream overlaps it until `wait()` adds the stream dependency. Hangs are bounded by the timeout the
mesh's process groups were created with.

An all-to-all whose pieces lie end to end in one buffer each way (one per peer, in peer order: Ulysses' packed
buffers) goes as one `all_to_all_single`, eagerly and in CUDA graphs alike. Other transfers inside a CUDA-graph
capture go as one all-to-all of bytes instead of NCCL send/recv: a captured send/recv pair can hang at its
first replay, where a captured all_to_all_single replays. The price is a pack and an unpack copy, paid only by
graphed layers.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..core.mesh import Group
from .base import Done, Handle, Handles, Placed

_ASYNC = dist.AllToAllOptions()  # a collective posted on a process group itself: returns at once, waited on later
_ASYNC.asyncOp = True

# torch >= 2.13 renames all_gather_into_tensor; the old name still works on 2.9 - 2.12
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TorchTransport:
    name = kind = "torch"

    def __init__(self) -> None:
        self._coalesces: dict[tuple[dist.ProcessGroup, str], bool] = {}  # (group, device type) -> NCCL-style batch

    def recv_buffer(self, like: Tensor, shape: Sequence[int], peer: int, group: Group) -> Tensor:
        return like.new_empty(tuple(shape))

    def staging(self, group: Group, like: Tensor, shape: Sequence[int]) -> Tensor | None:
        """NCCL sends from any buffer: nothing to pack into."""
        return None

    def begin_layer(self, peer_bytes: int) -> None:
        """Two-sided transfers need no per-layer set-up."""

    def end_layer(self) -> None:
        """Every transfer was waited on by its handle."""

    def exchange(self, sends: Sequence[tuple[Tensor, int]], recvs: Sequence[tuple[Tensor, int]],
                 group: Group) -> Handle:
        me = group.index
        for _, peer in sends:
            if peer == me:
                raise ValueError("a rank does not send to itself; copy locally instead")
        like = sends[0][0] if sends else recvs[0][0] if recvs else None
        if like is not None and like.is_cuda and torch.cuda.is_current_stream_capturing():
            return exchange_as_all_to_all(sends, recvs, group)
        posted, copies = [], []
        for tensor, peer in sends:
            if tensor.numel():
                posted.append((True, tensor.contiguous(), peer))
        for view, peer in recvs:
            if view.numel():
                buffer = view if view.is_contiguous() else torch.empty(view.shape, dtype=view.dtype, device=view.device)
                posted.append((False, buffer, peer))
                if buffer is not view:
                    copies.append((view, buffer))
        handle = self._post(posted, group.pg) if posted else Done()
        return Placed(handle, copies) if copies else handle

    def _post(self, ops: list[tuple[bool, Tensor, int]], pg: dist.ProcessGroup) -> Handle:
        """Post sends (True) and receives (False) to group positions as one batch: what dist.batch_isend_irecv
        does, through the process group's own calls (its Python wrappers cost more host time than a small
        layer's transfer takes). NCCL coalesces them into one launch; gloo posts each at once."""
        device = ops[0][1].device
        key = (pg, device.type)
        coalesce = self._coalesces.get(key)
        if coalesce is None:
            coalesce = self._coalesces[key] = type(pg) is dist.ProcessGroup and \
                pg._get_backend(device).supports_coalescing
        if coalesce:
            pg._start_coalescing(device)
        works = []
        for send, t, peer in ops:
            works.append(pg.send([t], peer, 0) if send else pg.recv([t], peer, 0))
        if coalesce:
            return pg._end_coalescing(device)
        return Handles(works)

    def all_to_all(self, sends: Sequence[Sequence[Tensor]], recvs: Sequence[Sequence[Tensor]],
                   group: Group) -> Handle:
        packed = _end_to_end(sends) if group.size > 1 else None  # alone, only the local copy below
        unpacked = _end_to_end(recvs) if packed is not None else None
        if unpacked is not None and unpacked[0].dtype == packed[0].dtype:
            # one piece per peer each way, laid end to end in peer order (Ulysses' buffers): one collective,
            # posted on the process group itself (dist.all_to_all_single's checks cost a layer host time)
            return group.pg.alltoall_base(unpacked[0], packed[0], unpacked[1], packed[1], _ASYNC)
        # else as send / recv pairs, the local pieces copied beside them
        me, to_peers, from_peers = group.index, [], []
        for peer in range(len(group.ranks)):
            if peer != me:
                for t in sends[peer]:
                    to_peers.append((t, peer))
                for v in recvs[peer]:
                    from_peers.append((v, peer))
        handle = self.exchange(to_peers, from_peers, group)
        for src, dst in zip(sends[me], recvs[me], strict=True):  # on the compute stream, beside the transfer
            dst.copy_(src)
        return handle

    def all_gather(self, output: Tensor, input: Tensor, group: Group) -> Handle:
        if group.size == 1:
            output[0].copy_(input)
            return Done()
        flat = output.view(-1, *input.shape[1:])  # gloo wants the peers concatenated along dim 0, not stacked
        return _all_gather_single(flat, input.contiguous(), group=group.pg, async_op=True)


def _end_to_end(pieces: Sequence[Sequence[Tensor]]) -> tuple[Tensor, list[int]] | None:
    """The pieces as one flat tensor and each one's length, where every peer has one contiguous piece and they lie
    end to end in peer order in one storage; else None."""
    sizes, first, at = [], None, 0
    for peer_pieces in pieces:  # a loop of attribute reads: this runs at every Ulysses all-to-all
        if len(peer_pieces) != 1:
            return None
        t = peer_pieces[0]
        sizes.append(t.nbytes // t.itemsize)
        if not t.nbytes:  # an empty view has no address; it takes no room between its neighbours
            continue
        if first is None:
            first, at = t, t.data_ptr()
        elif t.data_ptr() != at or t.dtype is not first.dtype:
            return None
        if not t.is_contiguous():
            return None
        at += t.nbytes
    if first is None:
        return None if not pieces else (pieces[0][0].new_empty(0), sizes)
    return torch.as_strided(first, (sum(sizes),), (1,)), sizes


class _Unpacked:
    """Handle of `exchange_as_all_to_all`: once the bytes arrived, each receive buffer gets its piece."""

    def __init__(self, work: Handle, pieces: list[tuple[Tensor, Tensor]]):
        self.work, self.pieces = work, pieces

    def wait(self) -> None:
        self.work.wait()
        for buffer, piece in self.pieces:
            if buffer.is_contiguous():
                _bytes(buffer).copy_(piece)
            else:  # a strided view of the caller's result: through an aligned copy of the bytes
                buffer.copy_(piece.clone().view(buffer.dtype).view(buffer.shape))
        self.pieces = []


def _bytes(t: Tensor) -> Tensor:
    return t.view(-1).view(torch.uint8)


def exchange_as_all_to_all(sends: Sequence[tuple[Tensor, int]], recvs: Sequence[tuple[Tensor, int]],
                           group: Group) -> Handle:
    """`exchange` as one all-to-all of bytes over the whole group: per peer, the sends (and receives) in the
    order given, as send/recv match them. Every member of the group must call it (the schedules' exchanges are
    collective: every rank of a ring or torus group exchanges at the same step)."""
    if group.size == 1:
        return Done()
    to_peer: list[list[Tensor]] = [[] for _ in range(group.size)]
    from_peer: list[list[Tensor]] = [[] for _ in range(group.size)]
    for tensor, peer in sends:
        to_peer[peer].append(_bytes(tensor.contiguous()))
    for buffer, peer in recvs:
        from_peer[peer].append(buffer)
    device = next((t.device for t, _ in [*sends, *recvs]), None) or torch.device("cuda", torch.cuda.current_device())
    flat = [b for chunks in to_peer for b in chunks]
    send = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8, device=device)
    sizes = [[b.numel() * b.element_size() for b in chunks] for chunks in from_peer]
    received = torch.empty(sum(map(sum, sizes)), dtype=torch.uint8, device=device)
    work = dist.all_to_all_single(received, send, [sum(s) for s in sizes],
                                  [sum(b.numel() for b in chunks) for chunks in to_peer], group=group.pg,
                                  async_op=True)
    buffers = [b for chunks in from_peer for b in chunks]
    return _Unpacked(work, list(zip(buffers, received.split([n for s in sizes for n in s]))))
