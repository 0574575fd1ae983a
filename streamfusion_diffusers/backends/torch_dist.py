"""Two-sided transport over torch.distributed: NCCL on GPUs, gloo on the CPU.

Every transfer is posted with async_op=True; NCCL runs it on its own stream, so attention queued on the
compute stream overlaps it until `wait()` adds the stream dependency. Hangs are bounded by the timeout the
mesh's process groups were created with.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..mesh import Group
from .base import Done, Handle, Handles, Placed

# torch >= 2.13 renames all_gather_into_tensor; the old name still works on 2.9 - 2.12
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TorchTransport:
    name = "torch"

    def recv_buffer(self, like: Tensor, shape: Sequence[int], peer: int, group: Group) -> Tensor:
        return like.new_empty(tuple(shape))

    def begin_layer(self, peer_bytes: int) -> None:
        """Two-sided transfers need no per-layer set-up."""

    def end_layer(self) -> None:
        """Every transfer was waited on by its handle."""

    def exchange(self, sends: Sequence[tuple[Tensor, int]], recvs: Sequence[tuple[Tensor, int]],
                 group: Group) -> Handle:
        ops = []
        for tensor, peer in sends:
            if peer == group.index:
                raise ValueError("a rank does not send to itself; copy locally instead")
            if tensor.numel():
                ops.append(dist.P2POp(dist.isend, tensor.contiguous(), group=group.pg, group_peer=peer))
        for buffer, peer in recvs:
            if buffer.numel():
                ops.append(dist.P2POp(dist.irecv, buffer, group=group.pg, group_peer=peer))
        return Handles(dist.batch_isend_irecv(ops)) if ops else Done()

    def all_to_all(self, sends: Sequence[Sequence[Tensor]], recvs: Sequence[Sequence[Tensor]],
                   group: Group) -> Handle:
        me, ops, copies = group.index, [], []
        for peer in range(group.size):
            if peer == me:
                continue
            ops += [dist.P2POp(dist.isend, t.contiguous(), group=group.pg, group_peer=peer)
                    for t in sends[peer] if t.numel()]
            for view in recvs[peer]:
                if not view.numel():
                    continue
                buffer = view if view.is_contiguous() else torch.empty(view.shape, dtype=view.dtype, device=view.device)
                ops.append(dist.P2POp(dist.irecv, buffer, group=group.pg, group_peer=peer))
                if buffer is not view:
                    copies.append((view, buffer))
        handle = Handles(dist.batch_isend_irecv(ops)) if ops else Done()
        for src, dst in zip(sends[me], recvs[me], strict=True):  # on the compute stream, beside the transfer
            dst.copy_(src)
        return Placed(handle, copies) if copies else handle

    def all_gather(self, output: Tensor, input: Tensor, group: Group) -> Handle:
        if group.size == 1:
            output[0].copy_(input)
            return Done()
        flat = output.view(-1, *input.shape[1:])  # gloo wants the peers concatenated along dim 0, not stacked
        return _all_gather_single(flat, input.contiguous(), group=group.pg, async_op=True)
