"""Low-precision transfers between machines: chunks that cross a machine boundary travel as 1-byte values.

Across slow links an attention layer is bandwidth-bound; one byte per value halves the bytes of bf16 chunks.
Each chunk [..., D] is scaled per token and head (the amax of its D values maps to the codec's largest value)
and sent as one uint8 message (gloo and NCCL move bytes, not every 8-bit dtype): its bytes, then float32 scales;
restored to the chunk's dtype on arrival. Every inter-machine chunk uses the one codec asked for: Torus Pull Q
(Q), Pull KV (K and V), Push O (finished outputs, no LSE), and ring passes (K and V) that cross machines.
Ulysses all-to-alls and transfers inside a machine are passed on untouched (a one-machine job is bit-identical).

Rows are rotated by a Hadamard transform before quantizing and rotated back on arrival (xDiT's FP8 Ulysses
rotates Q and K; here every kind, as the rotation is undone at once): a DiT's Q and K carry a few channels
tens of times larger than the rest, which set the row's amax and so the step of every other value; rotated,
each value mixes all D channels and the row's amax is about 3-4 x its rms. Where D is not a power of two the
rows travel unrotated (both sides know D).

- "int8": round to 1/127 of the row's amax: evenly spaced levels over each scale, on Gaussian-like (rotated)
  rows the accurate code.
- "fp8" (float8_e4m3fn, largest 448): 3 mantissa bits, the same relative error whatever the scale or the
  rotation.

None of these errors is averaged away by the softmax: each kind of chunk (Q, K, V, O) adds its codec's
per-value error to the output about in full (Q and K more with sharper attention), so a Torus layer over
T machines is off by about sqrt(4 (T-1) / T) x that error. That is why int8 with the rotation is the code that
stays within the tests' bar with every kind travelling, outlier rows included, where no e4m3 variant does once
two kinds travel (BENCHMARKS.md: the study by kind, codec, rotation and scale granularity).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.mesh import Group
from .base import Handle, Transport


@functools.cache  # a constant of (d, device): a pure function's result, the same for every context
def hadamard(d: int, device: torch.device) -> Tensor:
    """The orthonormal Sylvester-Hadamard matrix of size d (a power of two), float32: symmetric, its own inverse."""
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return (h / math.sqrt(d)).to(device)


@dataclass(frozen=True)
class Codec:
    """A 1-byte wire format with per-(token, head) float32 scales, both in one uint8 message: the values, padded
    to 4 bytes, then the scales (one message per chunk: half the sends and receives of two, and one link latency).
    rotate: Hadamard-rotate rows of a power-of-two length before quantizing, and back after."""

    dtype: torch.dtype
    top: float  # the largest magnitude it holds; a row's amax is scaled to it
    rotate: bool = True

    def wire_bytes(self, shape: Sequence[int]) -> int:
        n = math.prod(shape)
        return -(-n // 4) * 4 + 4 * (n // shape[-1])

    def parts(self, wire: Tensor, shape: Sequence[int]) -> tuple[Tensor, Tensor]:
        """Views of a message: (values [*shape] in the codec's dtype, float32 scales [*shape[:-1]])."""
        n = math.prod(shape)
        start = -(-n // 4) * 4
        return (wire[:n].view(self.dtype).view(shape),
                wire[start:start + 4 * (n // shape[-1])].view(torch.float32).view(shape[:-1]))

    def rotates(self, d: int) -> bool:
        return self.rotate and d > 1 and d & (d - 1) == 0

    def encode(self, x: Tensor) -> Tensor:
        """x [..., D] -> one uint8 message with x ~= (value * scale) @ H per row of D (H = I unrotated).

        Three passes over x (amax, divide into float32, cast; int8 rounds in place between: casts truncate),
        after one matmul where rotated; no clamp: |x| <= amax, so a value exceeds top by float rounding at most
        and the cast rounds it back."""
        wire = torch.empty(self.wire_bytes(x.shape), dtype=torch.uint8, device=x.device)
        data, scale = self.parts(wire, x.shape)
        if self.rotates(x.shape[-1]):
            x = x.float() @ hadamard(x.shape[-1], x.device)  # a new tensor: never the caller's
        scale.copy_(torch.linalg.vector_norm(x, math.inf, dim=-1))  # the amax, one fused reduction
        scale.clamp_min_(torch.finfo(torch.float32).tiny).div_(self.top)  # an all-zero row divides by > 0
        wide = x / scale.unsqueeze(-1)  # float32, a new tensor: never the caller's
        if not self.dtype.is_floating_point:
            wide.round_()
        data.copy_(wide)
        return wire

    def decode(self, wire: Tensor, out: Tensor) -> Tensor:
        """Write (value * scale) @ H into out, in out's dtype: `encode`'s inverse up to its rounding. Unrotated,
        one pass for int8; float8 is first widened to out's dtype (exact), as torch promotes no float8 type with
        another. Rotated, the float32 product goes through the matmul and is rounded once into out."""
        data, scale = self.parts(wire, out.shape)
        if self.rotates(out.shape[-1]):
            wide = data.float() * scale.unsqueeze(-1)
            return out.copy_(wide @ hadamard(out.shape[-1], out.device))
        values = data.to(out.dtype) if self.dtype.is_floating_point else data
        return torch.mul(values, scale.unsqueeze(-1), out=out)  # float32 product, rounded once into out


CODECS: dict[str, Codec] = {"fp8": Codec(torch.float8_e4m3fn, torch.finfo(torch.float8_e4m3fn).max),
                            "int8": Codec(torch.int8, 127.0)}


class _Restore:
    """Handle that, once the wire transfer is done, dequantizes each received chunk into its buffer."""

    def __init__(self, inner: Handle, codec: Codec, restores: list[tuple[Tensor, Tensor]], held: list[Tensor]):
        self.inner, self.codec, self.restores, self.held = inner, codec, restores, held

    def wait(self) -> None:
        self.inner.wait()
        for out, wire in self.restores:
            self.codec.decode(wire, out)
        self.restores, self.held = [], []


class QuantizedTransport:
    """`inner` with inter-machine `exchange` chunks sent in a 1-byte codec plus scales (CODECS[comm_dtype], rows
    Hadamard-rotated); the machine of a rank is rank // gpus_per_machine."""

    def __init__(self, inner: Transport, comm_dtype: str, gpus_per_machine: int, rank: int):
        self.inner, self.codec = inner, CODECS[comm_dtype]
        self.gpus_per_machine, self.rank = gpus_per_machine, rank
        self.name = f"{inner.name}+{comm_dtype}"

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
                wire = self.codec.encode(tensor)
                wire_sends.append((wire, peer))
                held.append(wire)  # alive until the transfer is waited on
            else:
                wire_sends.append((tensor, peer))
        for buffer, peer in recvs:
            if buffer.numel() and self._remote(group, peer):
                wire = self.inner.recv_buffer(buffer.new_empty(0, dtype=torch.uint8),
                                              (self.codec.wire_bytes(buffer.shape),), peer, group)
                wire_recvs.append((wire, peer))
                restores.append((buffer, wire))
            else:
                wire_recvs.append((buffer, peer))
        handle = self.inner.exchange(wire_sends, wire_recvs, group)
        return _Restore(handle, self.codec, restores, held) if restores or held else handle
