"""Ulysses all-to-all: trade a sequence slice with all heads for a longer sequence with fewer heads.

Heads are grouped as [T, U', h] (torus part, intra-Ulysses part, heads per rank). `scatter_heads` runs the
intra-Ulysses part of the all-to-all in one piece and leaves the torus part for Torus stages; its output is
head-part-major, [T, B, L_part, h, D], so each torus chunk Q_{l,tau} is one contiguous tensor.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..backends import Transport
from ..mesh import Mesh


def _peer_lens(mesh: Mesh, seq_lens: Sequence[int]) -> list[int]:
    lay = mesh.layout
    return [seq_lens[lay.rank(mesh.t, u, mesh.r)] for u in range(lay.ulysses_intra)]


def scatter_heads(xs: Sequence[Tensor], mesh: Mesh, transport: Transport, seq_lens: Sequence[int]) -> list[Tensor]:
    """[B, L_rank, H, D] tensors -> [T, B, L_part, h, D]: this rank's heads over its intra-Ulysses peers' slices."""
    return post_scatter_heads(xs, mesh, transport, seq_lens)()


def post_scatter_heads(xs: Sequence[Tensor], mesh: Mesh, transport: Transport,
                       seq_lens: Sequence[int]) -> Callable[[], list[Tensor]]:
    """`scatter_heads` in two halves: post the all-to-all now, and return the call that waits for it and lays
    the result out, so that other work (the next wave's projections, waves.py) runs while it travels."""
    lay = mesh.layout
    n_t, n_u = lay.torus, lay.ulysses_intra
    b, length, heads, d = xs[0].shape
    h = heads // (n_t * n_u)
    if n_u == 1:
        out = [x.view(b, length, n_t, h, d).permute(2, 0, 1, 3, 4).contiguous() for x in xs]
        return lambda: out
    # one all-to-all for all of xs (Q, K and V together), and one copy each way: every tensor goes straight into
    # its slot of the peer-major send buffer [U', n, B, L, T, h, D], and every peer's piece straight into its rows
    # of the result [n, T, B, L_part, h, D]
    n = len(xs)
    send = torch.stack([x.view(b, length, n_t, n_u, h, d).permute(3, 0, 1, 2, 4, 5) for x in xs], dim=1)
    lens = _peer_lens(mesh, seq_lens)
    per_token = n * b * n_t * h * d
    recv = send.new_empty(per_token * sum(lens))
    handle = transport.all_to_all(recv, send.view(-1), [per_token * m for m in lens], [per_token * length] * n_u,
                                  mesh.ulysses)

    def finish() -> list[Tensor]:
        handle.wait()
        if len(set(lens)) == 1:  # equal slices: the whole receive buffer in one copy
            gathered = recv.view(n_u, n, b, length, n_t, h, d).permute(1, 4, 2, 0, 3, 5, 6)
            return list(gathered.reshape(n, n_t, b, n_u * length, h, d).unbind(0))
        gathered = recv.new_empty((n, n_t, b, sum(lens), h, d))
        start = 0
        for piece, m in zip(recv.split([per_token * m for m in lens]), lens):
            gathered[:, :, :, start:start + m] = piece.view(n, b, m, n_t, h, d).permute(0, 3, 1, 2, 4, 5)
            start += m
        return list(gathered.unbind(0))

    return finish


def gather_heads(out: Sequence[Tensor], mesh: Mesh, transport: Transport, seq_lens: Sequence[int]) -> Tensor:
    """The inverse of `scatter_heads` for one tensor given as its T head parts [B, L_part, h, D] each."""
    return post_gather_heads(out, mesh, transport, seq_lens)()


def post_gather_heads(out: Sequence[Tensor], mesh: Mesh, transport: Transport,
                      seq_lens: Sequence[int]) -> Callable[[], Tensor]:
    """`gather_heads` in two halves, as `post_scatter_heads`."""
    lay = mesh.layout
    n_t, n_u = lay.torus, lay.ulysses_intra
    b, _, h, d = out[0].shape
    one = n_t == 1 and out[0].is_contiguous()
    stacked = out[0].unsqueeze(2) if one else torch.stack(list(out), dim=2)  # [B, L_part, T, h, D]
    if n_u == 1:
        result = stacked.reshape(b, -1, n_t * h, d)
        return lambda: result
    lens = _peer_lens(mesh, seq_lens)
    length = lens[mesh.u]
    if b == 1:  # peers' rows are consecutive: already peer-major, sent as it lies (no copy with one head part)
        send = stacked.view(-1)
    else:
        send = torch.cat([p.reshape(-1) for p in stacked.split(lens, dim=1)])  # peer-major: [U', B, L, T, h, D]
    per_token = b * n_t * h * d
    recv = send.new_empty(n_u * per_token * length)
    handle = transport.all_to_all(recv, send, [per_token * length] * n_u, [per_token * n for n in lens],
                                  mesh.ulysses)

    def finish() -> Tensor:
        handle.wait()
        # recv: [U', B, L, T, h, D] -> [B, L, T, U', h, D] -> [B, L, H, D]
        return recv.view(n_u, b, length, n_t, h, d).permute(1, 2, 3, 0, 4, 5).reshape(b, length, n_t * n_u * h, d)

    return finish
