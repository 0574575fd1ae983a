"""Joint (replicated) tokens: Flux's and CogVideoX's text tokens, kept whole on every rank.

Each rank attends its share of the joint queries (rows split over ring peers, its own heads) and one
all-gather over the world puts the joint output back together, every row and head exactly once.
"""
from __future__ import annotations

from torch import Tensor

from ..backends import Transport
from ..core.mesh import Mesh
from ..core.sequence import split_sizes
from ..kernels.partial import Partial
from .torus import JointShard, finished


def _head_slice(mesh: Mesh, t: int, u: int, h: int) -> slice:
    start = (t * mesh.layout.ulysses_intra + u) * h
    return slice(start, start + h)


def _row_slice(rows: list[int], r: int) -> slice:
    start = sum(rows[:r])
    return slice(start, start + rows[r])


def joint_shard(q: Tensor, k: Tensor, v: Tensor, mesh: Mesh) -> JointShard:
    """This rank's joint query rows and the joint K, V of its heads ([B, L, h, D] views, no copies)."""
    lay = mesh.layout
    h = q.shape[2] // lay.ulysses
    heads = _head_slice(mesh, mesh.t, mesh.u, h)
    rows = slice(None) if lay.ring == 1 else _row_slice(split_sizes(q.shape[1], lay.ring), mesh.r)
    return JointShard(q[:, rows, heads], k[:, :, heads], v[:, :, heads], Partial())


def gather_joint(shard: JointShard, like: Tensor, mesh: Mesh, transport: Transport) -> Tensor:
    """All ranks' joint output shards -> the full [B, L_joint, H, D] joint output on every rank."""
    lay = mesh.layout
    b, length, heads, d = like.shape
    h = heads // lay.ulysses
    mine = finished(shard.partial, shard.q)
    if lay.ring == 1 and lay.torus == 1:  # every row of rank i's heads (the i-th h) on rank i: one gather, no copy
        everyone = mine.new_empty((lay.world_size, *mine.shape))
        transport.all_gather(everyone, mine, mesh.world).wait()
        return everyone.permute(1, 2, 0, 3, 4).reshape(b, length, heads, d)
    rows = split_sizes(length, lay.ring)
    padded = mine.new_zeros((b, max(rows), h, d))
    padded[:, : mine.shape[1]] = mine
    everyone = padded.new_empty((lay.world_size, *padded.shape))
    transport.all_gather(everyone, padded, mesh.world).wait()
    out = like.new_empty(like.shape)
    for rank in range(lay.world_size):
        t, u, r = lay.coords(rank)
        out[:, _row_slice(rows, r), _head_slice(mesh, t, u, h)] = everyone[rank, :, : rows[r]]
    return out
