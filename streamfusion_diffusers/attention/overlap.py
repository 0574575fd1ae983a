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

With one group nothing of the attention is left to pipeline; a caller with work of its own that needs no
attention output passes it as `beside`: it runs while Q/K/V travel and while the output travels (a Flux single
block's MLP projections, diffusers/overlap_mlp.py), with the projections whole.

Only for pure Ulysses inside the attention (torus T = 1, ring R = 1) over a torch transport (NCCL or gloo): every
wait is a stream wait, so the schedule is captured by a CUDA graph as it runs eagerly.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor

from ..backends import Transport
from ..context import ParallelContext
from ..core.mesh import Mesh
from ..core.transports import transport_spec
from ..kernels.attend import attend_chunks
from ..kernels.choice import agreed_choices
from ..kernels.partial import Partial
from .agreement import agreed_seq_lens
from .joint import gather_joint, joint_shard
from .torus import JointShard, finished
from .ulysses import post_gather_heads, post_scatter_heads
from .volume import peer_bytes

__all__ = ["OverlapPlan", "overlap_plan", "run_overlapped"]

Project = Callable[[int], tuple[Tensor, Tensor, Tensor]]
OutProject = Callable[[int, Tensor], tuple[Tensor, ...]]


@dataclass(frozen=True)
class OverlapPlan:
    """One call's pipeline: its mesh and kernel, every rank's slice length, the joint rows, the group count and
    the SMs that GEMMs beside an exchange leave to it."""

    mesh: Mesh
    kernel: str
    lens: list[int]
    joint: int
    groups: int
    exchange_sms: int = 0


def overlap_plan(ctx: ParallelContext, like: Tensor, joint_len: int = 0,
                 seq_lens: Sequence[int] | None = None, groups: int | None = None) -> OverlapPlan | None:
    """The pipeline for q shaped `like` ([B, J + L_local, H, D]; an expanded scalar will do), or None for the
    plain path (not asked for, no all-to-all to hide, torus or ring stages, a one-sided transport). groups: the
    head groups (None: the config's overlap_groups; 1: one group, for a caller that hides the exchanges behind
    work of its own, `run_overlapped`'s `beside`). Collective on a new shape (the layout choice and the shape
    agreement), like `sp_attention`."""
    asked = ctx.config.overlap_groups if groups is None else groups
    if asked is None or (asked == 1 and groups is None) or ctx.world_size == 1 or \
            not transport_spec(ctx.transport.kind).overlap:
        return None
    rows = like[:, joint_len:]
    joint = (like[:, :joint_len],) * 3 if joint_len else (None, None, None)
    lens = agreed_seq_lens(ctx, rows, rows, rows, joint, seq_lens)  # every rank agrees (once per shape)
    mesh, kernel = ctx.attention_plan(rows, lens, joint_len)  # method "auto" chooses here, once per shape
    lay = mesh.layout
    if lay.torus != 1 or lay.ring != 1 or lay.ulysses_intra == 1:
        return None
    per_rank = like.shape[2] // lay.ulysses
    if per_rank % asked:
        raise ValueError(f"overlap_groups={asked} does not divide the {per_rank} heads each rank attends "
                         f"({like.shape[2]} heads over Ulysses degree {lay.ulysses}); pass a divisor of "
                         f"{per_rank}, or 1 (or None) to turn overlap off")
    return OverlapPlan(mesh, kernel, lens, joint_len, asked, ctx.config.exchange_sms)


def run_overlapped(ctx: ParallelContext, plan: OverlapPlan, like: Tensor, project: Project,
                   out_project: OutProject | None = None, scale: float | None = None,
                   beside: tuple[Callable[[], None], Callable[[], None]] | None = None
                   ) -> Tensor | tuple[Tensor, ...]:
    """The attention of every head group over the whole sequence, pipelined with the projections. Returns the
    sums of `out_project`'s tensors over the groups, or without it the attention output [B, J + L_local, H, D].
    beside: the caller's own work that needs no attention output, (first, last): `first` runs while the first
    group's Q/K/V travel, `last` while the last group's output does (a Flux single block's MLP projections)."""
    b, _, heads, d = like.shape
    transport = ctx.transport
    transport.begin_layer(peer_bytes(plan.mesh.layout, plan.lens, b, heads, d, plan.joint, like.element_size()))
    h = heads // plan.groups
    signature = ("sp_attention", plan.mesh.layout, tuple(plan.lens), plan.joint, b, h, d, like.dtype)
    try:
        with agreed_choices(ctx.kernels, ctx.cfg.sp, signature, like[:, :, :h], plan.kernel):
            return _Pipeline(plan, transport, scale, project, out_project, beside, like.is_cuda).run()
    finally:
        transport.end_layer()  # also on an error: every transfer posted is over before it propagates


def _nothing() -> None:
    """No work beside the exchanges."""


@contextmanager
def sms_left(count: int) -> Iterator[None]:
    """cuBLAS GEMMs issued inside leave `count` SMs free: a GEMM that fills every SM holds the all-to-all's
    kernels back until it ends, so without this an exchange "beside" a projection runs after it."""
    if not count:
        yield
        return
    before = torch._C._get_sm_carveout_experimental()
    _set_carveout(count)
    try:
        yield
    finally:
        _set_carveout(before)


def _set_carveout(count: int | None) -> None:
    """torch's setter, whose first call prints an "experimental" notice from C++ on every rank: that one call
    runs with the process's stderr pointed at /dev/null."""
    global _warned
    if _warned:
        torch._C._set_sm_carveout_experimental(count)
        return
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        torch._C._set_sm_carveout_experimental(count)
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)
        _warned = True


_warned = False


class _Pipeline:
    """One layer's schedule over the head groups (the module docstring draws it)."""

    def __init__(self, plan: OverlapPlan, transport: Transport, scale: float | None, project: Project,
                 out_project: OutProject | None, beside: tuple[Callable[[], None], Callable[[], None]] | None,
                 cuda: bool):
        self.mesh, self.transport, self.lens, self.joint = plan.mesh, transport, plan.lens, plan.joint
        self.groups, self.scale, self.kernel = plan.groups, scale, plan.kernel
        self.sms = plan.exchange_sms if cuda else 0  # cuBLAS's setting: nothing to leave on the CPU
        self.project, self.out_project = project, out_project
        self.first, self.last = beside or (_nothing, _nothing)

    def run(self) -> Tensor | tuple[Tensor, ...]:
        groups = self.groups
        inbound, outbound, parts = self.post_in(0), [], []
        with sms_left(self.sms):
            self.first()  # in(0) travels meanwhile
        for g in range(groups):
            following = None
            if g + 1 < groups:
                with sms_left(self.sms):
                    following = self.post_in(g + 1)  # projected while in(g) travels
            outbound.append(self.attend(*inbound))  # in(g + 1) travels meanwhile
            inbound = following
            if g > 0:
                with sms_left(self.sms):
                    parts.append(self.finish(g - 1, *outbound[g - 1]))  # while out(g) travels
        with sms_left(self.sms):
            self.last()  # out(G - 1) travels meanwhile
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
