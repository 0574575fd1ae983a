"""FP8 transfers between machines: chunks that cross a machine boundary travel as float8_e4m3fn with scales.

Across slow links an attention layer is bandwidth-bound, and FP8 halves the bytes of bf16 chunks. Each chunk
[..., D] is scaled per token and head (the amax of its D values maps to 448, e4m3's largest) and sent as its
FP8 bytes (a uint8 view: gloo and NCCL move bytes, not every float8 dtype) plus float32 scales, then restored to
the chunk's dtype on arrival. Transfers inside a machine, and chunks headed there, are passed on untouched, so
a one-machine job is bit-identical with and without FP8. Wrapping the transport keeps the schedules as they
are: Torus stages (pull_q, pull_kv, push_o) and ring passes all move chunks by `exchange`.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..mesh import Group
from .base import Handle, Transport

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., D] -> (FP8 bytes [..., D] as uint8, float32 scales [...]) with x ~= bytes * scale."""
    wide = x.float()
    scale = wide.abs().amax(dim=-1).clamp_min(torch.finfo(torch.float32).tiny) / FP8_MAX
    data = (wide / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return data.view(torch.uint8), scale


def dequantize(data: Tensor, scale: Tensor, out: Tensor) -> Tensor:
    """Write bytes * scale into out (in out's dtype); the inverse of `quantize`, up to FP8 rounding."""
    return out.copy_(data.view(FP8).float() * scale.unsqueeze(-1))


class _Restore:
    """Handle that, once the wire transfer is done, dequantizes each received chunk into its buffer."""

    def __init__(self, inner: Handle, restores: list[tuple[Tensor, Tensor, Tensor]], held: list[Tensor]):
        self.inner, self.restores, self.held = inner, restores, held

    def wait(self) -> None:
        self.inner.wait()
        for out, data, scale in self.restores:
            dequantize(data, scale, out)
        self.restores, self.held = [], []


class Fp8Transport:
    """`inner` with inter-machine `exchange` chunks sent as FP8 plus scales; machine of a rank = rank // M."""

    def __init__(self, inner: Transport, gpus_per_machine: int, rank: int):
        self.inner, self.gpus_per_machine, self.rank = inner, gpus_per_machine, rank
        self.name = f"{inner.name}+fp8"

    def __getattr__(self, name: str):
        """Buffers, layer hooks and collectives (all-to-all, all-gather) are the inner transport's."""
        return getattr(self.inner, name)

    def _remote(self, group: Group, peer: int) -> bool:
        return group.ranks[peer] // self.gpus_per_machine != self.rank // self.gpus_per_machine

    def exchange(self, sends: Sequence[tuple[Tensor, int]], recvs: Sequence[tuple[Tensor, int]],
                 group: Group) -> Handle:
        wire_sends: list[tuple[Tensor, int]] = []
        wire_recvs: list[tuple[Tensor, int]] = []
        restores, held = [], []
        for tensor, peer in sends:
            if tensor.numel() and self._remote(group, peer):
                data, scale = quantize(tensor)
                wire_sends += [(data, peer), (scale, peer)]
                held += [data, scale]  # alive until the transfer is waited on
            else:
                wire_sends.append((tensor, peer))
        for buffer, peer in recvs:
            if buffer.numel() and self._remote(group, peer):
                data = self.inner.recv_buffer(buffer.new_empty(0, dtype=torch.uint8), buffer.shape, peer, group)
                scale = self.inner.recv_buffer(buffer.new_empty(0, dtype=torch.float32), buffer.shape[:-1], peer,
                                               group)
                wire_recvs += [(data, peer), (scale, peer)]
                restores.append((buffer, data, scale))
            else:
                wire_recvs.append((buffer, peer))
        handle = self.inner.exchange(wire_sends, wire_recvs, group)
        return _Restore(handle, restores, held) if restores or held else handle
