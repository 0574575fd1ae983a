"""Ulysses with its all-to-alls beside the caller's own work, which needs no attention output.

The caller projects Q, K, V and hands over two callables of its own work (a Flux single block's MLP projections,
diffusers/overlap_mlp.py); on the compute stream, the exchanges on the transport's:

    post Q/K/V | first()  (Q/K/V travel) | wait, attend, post the output | last()  (the output travels) | wait

The projections stay whole. Pipelining Ulysses over head groups instead (each group's exchange beside the next
group's projection) hides more of the exchanges but makes every GEMM smaller and shares the SMs with them, and
the step came out slower, so it is not kept.

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

__all__ = ["OverlapPlan", "overlap_plan", "run_overlapped", "sms_left"]


@dataclass(frozen=True)
class OverlapPlan:
    """One call's schedule: its mesh and kernel, every rank's slice length, the joint rows and the SMs that GEMMs
    beside an exchange leave to it."""

    mesh: Mesh
    kernel: str
    lens: list[int]
    joint: int
    exchange_sms: int = 0


def overlap_plan(ctx: ParallelContext, like: Tensor, joint_len: int = 0,
                 seq_lens: Sequence[int] | None = None) -> OverlapPlan | None:
    """The schedule for q shaped `like` ([B, J + L_local, H, D]; an expanded scalar will do), or None for the
    plain path (no all-to-all to run beside, torus or ring stages, a one-sided transport). Collective on a new
    shape (the layout choice and the shape agreement), like `sp_attention`."""
    if ctx.world_size == 1 or not transport_spec(ctx.transport.kind).overlap:
        return None
    rows = like[:, joint_len:]
    joint = (like[:, :joint_len],) * 3 if joint_len else (None, None, None)
    lens = agreed_seq_lens(ctx, rows, rows, rows, joint, seq_lens)  # every rank agrees (once per shape)
    mesh, kernel = ctx.attention_plan(rows, lens, joint_len)  # method "auto" chooses here, once per shape
    lay = mesh.layout
    if lay.torus != 1 or lay.ring != 1 or lay.ulysses_intra == 1:
        return None
    return OverlapPlan(mesh, kernel, lens, joint_len, ctx.config.exchange_sms)


def run_overlapped(ctx: ParallelContext, plan: OverlapPlan, q: Tensor, k: Tensor, v: Tensor,
                   first: Callable[[], None], last: Callable[[], None], scale: float | None = None) -> Tensor:
    """The attention of q, k, v ([B, J + L_local, H, D], joint rows first) over the whole sequence, [B, J +
    L_local, H, D]: `first` runs while Q/K/V travel, `last` while the output does."""
    b, _, heads, d = q.shape
    transport = ctx.transport
    transport.begin_layer(peer_bytes(plan.mesh.layout, plan.lens, b, heads, d, plan.joint, q.element_size()))
    signature = ("sp_attention", plan.mesh.layout, tuple(plan.lens), plan.joint, b, heads, d, q.dtype)
    sms = plan.exchange_sms if q.is_cuda else 0  # cuBLAS's setting: nothing to leave on the CPU
    try:
        kernel = ctx.kernel_now(plan.kernel)
        with agreed_choices(ctx.kernels, ctx.cfg.sp, signature, q, kernel):
            inbound = _post_in(plan, transport, q, k, v)
            with sms_left(sms):
                first()
            gathered, joint_out = _attend(plan, transport, scale, kernel, *inbound)
            with sms_left(sms):
                last()
            out = gathered()
    finally:
        transport.end_layer()  # also on an error: every transfer posted is over before it propagates
    return out if joint_out is None else torch.cat([joint_out, out], dim=1)


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


def _post_in(plan: OverlapPlan, transport: Transport, q: Tensor, k: Tensor, v: Tensor
             ) -> tuple[Callable[[], list[Tensor]], JointShard | None, Tensor | None]:
    """Q/K/V posted to their heads' ranks: the wait for them, the joint rows' shard and the joint queries."""
    j = plan.joint
    shard = joint_shard(q[:, :j], k[:, :j], v[:, :j], plan.mesh) if j else None
    front = (shard.q, shard.k, shard.v) if shard is not None else ()
    wait = post_scatter_heads((q[:, j:], k[:, j:], v[:, j:]), plan.mesh, transport, plan.lens, front)
    return wait, shard, (q[:, :j] if j else None)


def _attend(plan: OverlapPlan, transport: Transport, scale: float | None, kernel: str,
            wait: Callable[[], list[Tensor]], shard: JointShard | None, joint_q: Tensor | None
            ) -> tuple[Callable[[], Tensor], Tensor | None]:
    """This rank's heads attended over the whole sequence, their output posted back: the wait for it, and the
    joint rows' output."""
    xq, xk, xv = (x[0] for x in wait())
    partial = Partial()
    attend_chunks([partial], [xq], [(xk, xv)], scale, kernel, finalize=True)
    out = finished(partial, xq)
    skip = shard.q.shape[1] if shard is not None else 0
    gathered = post_gather_heads([out[:, skip:]], plan.mesh, transport, plan.lens)
    if shard is None:
        return gathered, None
    done = JointShard(shard.q, shard.k, shard.v, Partial(out[:, :skip], None, True))
    return gathered, gather_joint(done, joint_q, plan.mesh, transport)
