"""Ulysses all-to-all: trade a sequence slice with all heads for a longer sequence with fewer heads.

Heads are grouped as [T, U', h] (torus part, intra-Ulysses part, heads per rank). `scatter_heads` runs the
intra-Ulysses part of the all-to-all in one piece and leaves the torus part for Torus stages; its output is
head-part-major, [T, B, L_part, h, D], so each torus chunk Q_{l,tau} is one contiguous tensor.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate

import torch
from torch import Tensor

from ..backends import Transport
from ..core.mesh import Mesh


def peer_lens(mesh: Mesh, seq_lens: Sequence[int]) -> list[int]:
    """The slice lengths of this rank's intra-Ulysses peers, in the order the all-to-all lays their rows."""
    return list(map(seq_lens.__getitem__, mesh.ulysses_peers))  # map, not a comprehension: no Python frame


def scatter_heads(xs: Sequence[Tensor], mesh: Mesh, transport: Transport, seq_lens: Sequence[int],
                  front: Sequence[Tensor] = ()) -> list[Tensor]:
    """[B, L_rank, H, D] tensors -> [T, B, L_part, h, D]: this rank's heads over its intra-Ulysses peers' slices.

    front (T = 1 only): one [B, J, h, D] tensor per x, its rows put before the sequence in the result, so that
    tokens every rank holds (the joint text) join it without a concatenation later."""
    return post_scatter_heads(xs, mesh, transport, seq_lens, front)()


def post_scatter_heads(xs: Sequence[Tensor], mesh: Mesh, transport: Transport, seq_lens: Sequence[int],
                       front: Sequence[Tensor] = ()) -> Callable[[], list[Tensor]]:
    """`scatter_heads` in two halves: post the all-to-all now, and return the call that waits for it, so that
    other work runs while it travels."""
    lay = mesh.layout
    n_t, n_u = lay.torus, lay.ulysses_intra
    b, length, heads, d = xs[0].shape
    h = heads // (n_t * n_u)
    if front and n_t > 1:
        raise ValueError("scatter_heads puts rows in front of the sequence only with torus degree 1")
    parts = [x.view(b, length, n_t, n_u, h, d).permute(3, 2, 0, 1, 4, 5) for x in xs]  # [U', T, B, L, h, D]
    if n_u == 1 and not front:
        out = [p[0].contiguous() for p in parts]
        return lambda: out
    # one piece each way per peer: what goes to every peer packed peer-major in one copy, [U', n, T, B, L, h, D],
    # and what comes from peer j into its own [n, T, B, L_j, h, D] run of one buffer (the transport copies the
    # local piece); the result is laid out once the pieces are in, the front rows meanwhile. A transport that
    # sends from buffers of its own (staging) has the sends packed there and lays peer j's rows in the result
    n, lens, skip = len(xs), peer_lens(mesh, seq_lens), front[0].shape[1] if front else 0
    staged = transport.staging(mesh.ulysses_intra, xs[0], (n_u, n, n_t, b, length, h, d)) \
        if min(lens) == max(lens) else None
    send = torch.stack(parts, dim=1, out=staged)
    runs = list(accumulate(lens, initial=0))
    out = xs[0].new_empty((n, n_t, b, skip + runs[-1], h, d))
    rows = out[:, :, :, skip:]
    received = None
    if staged is not None:
        pieces = [rows[:, :, :, runs[j]:runs[j + 1]] for j in range(n_u)]
    else:
        row = n * n_t * b * h * d  # elements of one sequence row of every tensor's pieces
        received = xs[0].new_empty(row * sum(lens))
        pieces = [received[row * runs[j]:row * runs[j + 1]].view(n, n_t, b, lens[j], h, d) for j in range(n_u)]
    handle = transport.all_to_all([[send[j]] for j in range(n_u)], [[piece] for piece in pieces], mesh.ulysses_intra)
    for i, front_rows in enumerate(front):
        out[i, 0, :, :skip].copy_(front_rows)

    def finish() -> list[Tensor]:
        handle.wait()
        if received is None:  # the transport laid the rows in place
            return list(out.unbind(0))
        if min(lens) == max(lens):  # one copy: [U', n, T, B, L, h, D] -> [n, T, B, U' L, h, D]
            rows.unflatten(3, (n_u, lens[0])).copy_(received.view(n_u, n, n_t, b, lens[0], h, d).permute(
                1, 2, 3, 0, 4, 5, 6))
        else:
            for j, piece in enumerate(pieces):
                rows[:, :, :, runs[j]:runs[j + 1]].copy_(piece)
        return list(out.unbind(0))

    return finish


def gather_heads(out: Sequence[Tensor], mesh: Mesh, transport: Transport, seq_lens: Sequence[int]) -> Tensor:
    """The inverse of `scatter_heads` for one tensor given as its T head parts [B, L_part, h, D] each."""
    return post_gather_heads(out, mesh, transport, seq_lens)()


def post_gather_heads(out: Sequence[Tensor], mesh: Mesh, transport: Transport,
                      seq_lens: Sequence[int]) -> Callable[[], Tensor]:
    """`gather_heads` in two halves, as `post_scatter_heads`."""
    lay = mesh.layout
    n_t, n_u, me = lay.torus, lay.ulysses_intra, mesh.u
    b, _, h, d = out[0].shape
    if n_u == 1:
        result = out[0] if n_t == 1 else torch.stack(list(out), dim=2).reshape(b, -1, n_t * h, d)
        return lambda: result
    lens = peer_lens(mesh, seq_lens)
    length, runs = lens[me], list(accumulate(lens, initial=0))
    staged = transport.staging(mesh.ulysses_intra, out[0], (n_u, n_t, b, length, h, d)) \
        if n_t == 1 and min(lens) == max(lens) else None
    if staged is not None:  # packed in the transport's buffer, each peer's heads pulled into place in the result
        return _gather_in_place(out[0], staged, mesh, transport)
    # one piece each way per peer, into one [U', T, B, L, h, D]: where one contiguous head part of batch 1 holds
    # the rows of peer j end to end, they go as they lie; else packed peer-major, [T, B, L_j, h, D] runs of one
    # buffer (the kernels' outputs are often strided: packing is the copy a strided send would make anyway)
    recv = out[0].new_empty((n_u, n_t, b, length, h, d))
    if n_t == 1 and b == 1 and out[0].is_contiguous():
        sends = [[out[0][:, runs[j]:runs[j + 1]]] for j in range(n_u)]
        recvs = [[recv[j, 0]] for j in range(n_u)]
    else:
        row = n_t * b * h * d
        packed = out[0].new_empty(row * runs[-1])
        pieces = [packed[row * runs[j]:row * runs[j + 1]].view(n_t, b, lens[j], h, d) for j in range(n_u)]
        even = min(lens) == max(lens)
        for t, o in enumerate(out):
            if even:  # one copy per head part: [B, U' L, h, D] -> [U', B, L, h, D]
                packed.view(n_u, n_t, b, length, h, d)[:, t].copy_(o.unflatten(1, (n_u, length)).transpose(0, 1))
            else:
                for j, piece in enumerate(pieces):
                    piece[t].copy_(o[:, runs[j]:runs[j + 1]])
        sends = [[piece] for piece in pieces]
        recvs = [[recv[j]] for j in range(n_u)]
    handle = transport.all_to_all(sends, recvs, mesh.ulysses_intra)

    def finish() -> Tensor:
        handle.wait()
        # [U', T, B, L, h, D] -> [B, L, T, U', h, D] -> [B, L, H, D]: the one layout copy of the output
        return recv.permute(2, 3, 1, 0, 4, 5).reshape(b, length, n_t * n_u * h, d)

    return finish


def _gather_in_place(out: Tensor, staged: Tensor, mesh: Mesh, transport: Transport) -> Callable[[], Tensor]:
    """post_gather_heads (torus degree 1, even pieces) over a transport that sends from `staged`, its buffer
    [U', 1, B, L, h, D], and writes each piece where it goes: peer j's heads land in the result [B, L, H, D] as
    they travel, with no layout copy after them."""
    n_u, b, length, h, d = staged.shape[0], *staged.shape[2:]
    staged[:, 0].copy_(out.unflatten(1, (n_u, length)).transpose(0, 1))
    result = out.new_empty((b, length, n_u * h, d))
    heads = result.view(b, length, 1, n_u, h, d)
    recvs = [[heads[:, :, :, j].permute(2, 0, 1, 3, 4)] for j in range(n_u)]  # [1, B, L, h, D], as sent
    handle = transport.all_to_all([[staged[j]] for j in range(n_u)], recvs, mesh.ulysses_intra)

    def finish() -> Tensor:
        handle.wait()
        return result

    return finish
