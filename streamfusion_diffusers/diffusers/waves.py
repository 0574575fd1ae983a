"""Two-wave block overlap (TokenWeave, paper 004): a block's tokens run in waves, so that the sequence-parallel
transfers of one wave travel while the other wave computes.

Everything in a transformer block but attention acts token by token, so a block splits into a per-wave
`pre` (norms, modulation, Q/K/V projections, QK-norm, RoPE) and a per-wave `post` (output projection, gates,
residuals, MLP); `wave_blocks.py` cuts diffusers' Flux and CogVideoX blocks that way. The schedule:

    pre(0); post the Ulysses all-to-all of wave 0      | pre(1) computes while wave 0's Q, K, V travel
    pre(1); post the all-to-all of wave 1
    attention of every wave's queries over the K, V of both waves (the whole sequence)
    post the output all-to-all of wave 0 (of 1)        | with a pure Ulysses layout, wave 1's attention
                                                       |   computes while wave 0's output travels
    post(0)                                            | wave 1's output travels meanwhile
    post(1)

Waves cut this rank's sharded rows (replicated joint rows go with wave 0); every rank cuts every rank's rows
by the same rule, so the all-to-all splits agree. Attention sees the same queries and keys as without waves,
in another key order: exact up to float rounding. With ring or torus degrees above 1 the attention is the one
Torus schedule over the keys of both waves (its transfers need every key), so only the all-to-alls overlap.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from ..attention.joint import gather_joint, joint_shard
from ..attention.torus import TorusSchedule, finished
from ..attention.ulysses import _peer_lens, post_gather_heads, post_scatter_heads
from ..attention.volume import peer_bytes
from ..core.context import ParallelContext
from ..kernels import Partial, agreed_choices, attend_chunks
from .processors import TokenLayout

TILE_ROWS = 128  # rows of one GEMM tile on Hopper (cuBLAS / CUTLASS 128 x N tiles)


class WaveBlock(Protocol):
    """One block call cut into waves of consecutive local tokens [joint ; sharded]."""

    def pre(self, start: int, stop: int) -> tuple[Tensor, Tensor, Tensor]:
        """Q, K, V [B, stop - start, H, D] of local tokens [start, stop): everything before attention."""

    def post(self, start: int, stop: int, out: Tensor) -> None:
        """Attention output rows of tokens [start, stop) through everything after attention."""


def wave_sizes(rows: int, waves: int) -> list[int]:
    """`rows` split into `waves` near-equal parts whose boundaries fall on whole GEMM row tiles where there are
    enough rows (a ragged last tile in every wave would add a tile's work per GEMM); the first waves take the rest."""
    tiles = rows // TILE_ROWS
    if tiles < waves:
        base, extra = divmod(rows, waves)
        return [base + (1 if i < extra else 0) for i in range(waves)]
    per, extra = divmod(tiles, waves)
    sizes = [(per + (1 if i < extra else 0)) * TILE_ROWS for i in range(waves)]
    sizes[-1] += rows - tiles * TILE_ROWS
    return sizes


def auto_waves(rows: int, width: int, sm_count: int) -> int:
    """2 waves when each half of the block's narrowest GEMM (rows x width) still has a tile for every SM, so that
    neither wave leaves SMs idle; else 1 (a small per-GPU share is better run whole)."""
    half_tiles = -(-rows // (2 * TILE_ROWS)) * -(-width // TILE_ROWS)
    return 2 if half_tiles >= sm_count else 1


def sm_count() -> int:
    """SMs of this rank's GPU (0 on the CPU, where `auto` keeps one wave)."""
    if not torch.cuda.is_available():
        return 0
    return torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count


@torch.compiler.disable  # transfers are posted between the waves' parts: the whole wave schedule stays eager
def run_waves(block: WaveBlock, waves: int, ctx: ParallelContext, layout: TokenLayout, heads: int,
              scale: float | None = None) -> None:
    """Run one block call in `waves` waves; `block.post` receives every wave's attention output."""
    transport = ctx.transport
    joint, lens = layout.joint, layout.seq_lens
    cuts = [wave_sizes(n, waves) for n in lens]  # cuts[rank][wave]: every rank's waves, known to every rank
    wave_lens = [[cut[w] for cut in cuts] for w in range(waves)]
    bounds, end = [0], joint  # local token bounds of each wave; the joint rows ride with wave 0
    for size in cuts[layout.rank]:
        end += size
        bounds.append(end)
    posted: list[Callable[[], list[Tensor]]] = []
    jqkv: tuple[Tensor, ...] = ()
    begun = False
    try:
        for w in range(waves):
            q, k, v = block.pre(bounds[w], bounds[w + 1])
            if w == 0 and joint:
                jqkv, (q, k, v) = tuple(x[:, :joint] for x in (q, k, v)), tuple(x[:, joint:] for x in (q, k, v))
            if w == 0:  # the layout (method "auto" chooses it here, once per shape) and the kernel
                mesh, kernel = ctx.attention_plan(q, lens, joint)
                b, _, _, d = q.shape
                transport.begin_layer(peer_bytes(mesh.layout, lens, b, heads, d, joint, q.element_size()))
                begun = True
            posted.append(post_scatter_heads((q, k, v), mesh, transport, wave_lens[w]))
        parts = [finish() for finish in posted]  # per wave: Q, K, V as [T, B, L_part_w, h, D]
        shard = joint_shard(*jqkv, mesh) if jqkv else None
        part_lens = [sum(_peer_lens(mesh, wave_lens[w])) for w in range(waves)]
        signature = ("waves", waves, mesh.layout, tuple(lens), joint, b, heads, d, parts[0][0].dtype)
        with agreed_choices(ctx.kernels, ctx.cfg.sp, signature, parts[0][0], kernel):  # the same kernel everywhere
            gathers = _attend(parts, part_lens, shard, mesh, transport, lens, wave_lens, scale, kernel)
        joint_out = gather_joint(shard, jqkv[0], mesh, transport) if shard is not None else None
        for w, finish in enumerate(gathers):
            out = finish()
            if w == 0 and joint_out is not None:
                out = torch.cat([joint_out, out], dim=1)
            block.post(bounds[w], bounds[w + 1], out)
    finally:
        if begun:  # also on an error: every transfer the layer posted is over before it propagates
            transport.end_layer()


def _attend(parts, part_lens, shard, mesh, transport, lens, wave_lens, scale, kernel) -> list[Callable[[], Tensor]]:
    """Attention of every wave's queries over every wave's keys; returns each wave's posted output all-to-all."""
    if mesh.layout.torus == 1 and mesh.layout.ring == 1:  # attention is local: one wave's queries at a time
        # every key, the joint ones first, joined once (not once per attention call) into one K and one V
        front = [(shard.k, shard.v)] if shard is not None else []
        kv = [tuple(torch.cat([f[i] for f in front] + [p[i + 1][0] for p in parts], dim=1) for i in (0, 1))]
        if shard is not None:
            attend_chunks([shard.partial], [shard.q], kv, scale, kernel, finalize=True)
        gathers = []
        for w, (q, _, _) in enumerate(parts):
            partial = Partial()
            attend_chunks([partial], [q[0]], kv, scale, kernel, finalize=True)
            gathers.append(post_gather_heads([finished(partial, q[0])], mesh, transport, wave_lens[w]))
        return gathers
    keys = [torch.cat([p[i] for p in parts], dim=2) for i in (1, 2)]  # [T, B, L_part, h, D], waves in a row
    queries = torch.cat([p[0] for p in parts], dim=2)
    out = TorusSchedule(queries, *keys, mesh, transport, lens, shard, scale, kernel).run()
    pieces = [o.split(part_lens, dim=1) for o in out]
    return [post_gather_heads([p[w] for p in pieces], mesh, transport, wave_lens[w]) for w in range(len(parts))]


__all__ = ["WaveBlock", "auto_waves", "run_waves", "sm_count", "wave_sizes"]
