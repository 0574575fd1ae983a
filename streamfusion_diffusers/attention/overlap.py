"""Ulysses with its all-to-alls hidden behind the projections: heads in G groups, run as a pipeline.

The caller hands over two callables: `project(g)` -> (q, k, v) of head group g ([B, J + L_local, H/G, D], joint
rows first), and optionally `out_project(g, o_g)` -> the output projection's share of group g (a tuple of
tensors; their sums over the groups are the projected output). Group g holds the contiguous heads
[g H/G, (g+1) H/G), so its projection is a row slice of the Q/K/V weights and its share of the output
projection a column slice of the output weight: views, no copies. Within a group, rank j attends heads
j h/G .. (j+1) h/G - 1 of it, so a rank's heads differ from plain Ulysses' but every head is attended once,
exactly. The schedule, on the compute stream with the exchanges on the transport's:

    project 0, post in(0)
    for g: project g+1, post in(g+1)  (in(g) travels) | wait in(g), attend g  (in(g+1) travels)
           post out(g) | wait out(g-1), out-project g-1  (out(g) travels)
    wait out(G-1), out-project G-1

Only for pure Ulysses inside the attention (torus T = 1, ring R = 1) over a torch transport (NCCL or gloo): every
wait is a stream wait, so the schedule is captured by a CUDA graph as it runs eagerly.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ..context import ParallelContext
from ..core.mesh import Mesh
from ..kernels import Partial, agreed_choices, attend_chunks
from .agreement import agreed_seq_lens
from .joint import gather_joint, joint_shard
from .torus import JointShard, finished
from .ulysses import post_gather_heads, post_scatter_heads
from .volume import peer_bytes

__all__ = ["overlap_groups", "run_overlapped"]

Project = Callable[[int], tuple[Tensor, Tensor, Tensor]]
OutProject = Callable[[int, Tensor], tuple[Tensor, ...]]


def overlap_groups(ctx: ParallelContext, like: Tensor, joint_len: int = 0,
                   seq_lens: Sequence[int] | None = None) -> int:
    """How many head groups the pipeline runs for q shaped `like` ([B, J + L_local, H, D]); 1: the plain path
    (no all-to-all to hide, a layout with torus or ring stages, a one-sided transport, or overlap off).
    Collective on a new shape (the layout choice and the shape agreement)."""
    if ctx.world_size == 1 or not ctx.transport.name.startswith("torch"):
        return 1
    mesh, _ = _plan(ctx, like, joint_len, seq_lens)
    lay = mesh.layout
    if lay.torus != 1 or lay.ring != 1 or lay.ulysses_intra == 1:
        return 1
    per_rank = like.shape[2] // lay.ulysses
    asked = ctx.config.overlap_groups
    if asked is None:
        return 2 if per_rank % 2 == 0 else 1
    if per_rank % asked:
        raise ValueError(f"overlap_groups={asked} does not divide the {per_rank} heads each rank attends "
                         f"({like.shape[2]} heads over Ulysses degree {lay.ulysses}); pass a divisor of "
                         f"{per_rank}, or overlap_groups=None to choose, or 1 to turn overlap off")
    return asked


def run_overlapped(ctx: ParallelContext, groups: int, like: Tensor, project: Project,
                   out_project: OutProject | None = None, joint_len: int = 0,
                   seq_lens: Sequence[int] | None = None, scale: float | None = None) -> Tensor | tuple[Tensor, ...]:
    """The attention of every head group over the whole sequence, pipelined with the projections.

    like: a tensor shaped as the whole q ([B, J + L_local, H, D]; an expanded scalar will do). Returns the sums of
    `out_project`'s tensors over the groups, or without it the attention output [B, J + L_local, H, D]."""
    mesh, kernel = _plan(ctx, like, joint_len, seq_lens)
    lens = _lens(ctx, like, joint_len, seq_lens)
    b, _, heads, d = like.shape
    transport = ctx.transport
    transport.begin_layer(peer_bytes(mesh.layout, lens, b, heads, d, joint_len, like.element_size()))
    group_like = like[:, :, : heads // groups]
    signature = ("sp_attention", mesh.layout, tuple(lens), joint_len, b, heads // groups, d, like.dtype)
    try:
        with agreed_choices(ctx.kernels, ctx.cfg.sp, signature, group_like, kernel):
            return _Pipeline(mesh, ctx, lens, joint_len, scale, kernel, project, out_project).run(groups)
    finally:
        transport.end_layer()  # also on an error: every transfer posted is over before it propagates


def _plan(ctx: ParallelContext, like: Tensor, joint_len: int, seq_lens: Sequence[int] | None) -> tuple[Mesh, str]:
    return ctx.attention_plan(like[:, joint_len:], _lens(ctx, like, joint_len, seq_lens), joint_len)


def _lens(ctx: ParallelContext, like: Tensor, joint_len: int, seq_lens: Sequence[int] | None) -> list[int]:
    rows = like[:, joint_len:]
    joint = (like[:, :joint_len],) * 3 if joint_len else (None, None, None)
    return agreed_seq_lens(ctx, rows, rows, rows, joint, seq_lens)


class _Pipeline:
    """One layer's schedule over the head groups (the module docstring draws it)."""

    def __init__(self, mesh: Mesh, ctx: ParallelContext, lens: list[int], joint_len: int, scale: float | None,
                 kernel: str, project: Project, out_project: OutProject | None):
        self.mesh, self.transport, self.lens, self.joint = mesh, ctx.transport, lens, joint_len
        self.scale, self.kernel, self.project, self.out_project = scale, kernel, project, out_project

    def run(self, groups: int) -> Tensor | tuple[Tensor, ...]:
        inbound, outbound, parts = self.post_in(0), [], []
        for g in range(groups):
            following = self.post_in(g + 1) if g + 1 < groups else None  # projected while in(g) travels
            outbound.append(self.attend(*inbound))  # in(g + 1) travels meanwhile
            inbound = following
            if g > 0:
                parts.append(self.finish(g - 1, *outbound[g - 1]))  # while out(g) travels
        parts.append(self.finish(groups - 1, *outbound[-1]))
        if self.out_project is None:
            return torch.cat(parts, dim=2)
        total = list(parts[0])
        for part in parts[1:]:
            for acc, x in zip(total, part):
                acc.add_(x)
        return tuple(total)

    def post_in(self, g: int) -> tuple[Callable[[], list[Tensor]], JointShard | None, Tensor | None]:
        q, k, v = self.project(g)
        j = self.joint
        shard = joint_shard(q[:, :j], k[:, :j], v[:, :j], self.mesh) if j else None
        front = (shard.q, shard.k, shard.v) if shard is not None else ()
        wait = post_scatter_heads((q[:, j:], k[:, j:], v[:, j:]), self.mesh, self.transport, self.lens, front)
        return wait, shard, (q[:, :j] if j else None)

    def attend(self, wait: Callable[[], list[Tensor]], shard: JointShard | None, joint_q: Tensor | None
               ) -> tuple[Callable[[], Tensor], Tensor | None]:
        xq, xk, xv = (x[0] for x in wait())
        partial = Partial()
        attend_chunks([partial], [xq], [(xk, xv)], self.scale, self.kernel, finalize=True)
        out = finished(partial, xq)
        skip = shard.q.shape[1] if shard is not None else 0
        gathered = post_gather_heads([out[:, skip:]], self.mesh, self.transport, self.lens)
        if shard is None:
            return gathered, None
        done = JointShard(shard.q, shard.k, shard.v, Partial(out[:, :skip], None, True))
        return gathered, gather_joint(done, joint_q, self.mesh, self.transport)

    def finish(self, g: int, gathered: Callable[[], Tensor], joint_out: Tensor | None) -> Tensor | tuple[Tensor, ...]:
        out = gathered()
        if joint_out is not None:
            out = torch.cat([joint_out, out], dim=1)
        return out if self.out_project is None else self.out_project(g, out)
