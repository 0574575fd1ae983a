"""One `sp_attention` layer, run eagerly: exact softmax attention over a sequence split across ranks, by any of
the five methods (the custom op in `op.py` runs this for the compiler).

Every method is the same three steps on the mesh (torus T, intra-Ulysses U', ring R):
scatter heads over the intra-Ulysses group, run the Torus schedule (a single ring pass when T = 1, one
attention call when T = R = 1), gather heads back.
ulysses = (1, P, 1), ring = (1, 1, P), usp/tas = (1, U, R), torus = (T, U/T, R).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ..backends import Transport
from ..context import ParallelContext
from ..core.mesh import Group, Mesh
from ..core.sequence import gather
from ..kernels.attend import attend_chunks, attend_masked
from ..kernels.choice import agreed_choices
from ..kernels.partial import Partial
from .agreement import agreed_seq_lens
from .faults import EXACT, Exact
from .joint import gather_joint, joint_shard
from .torus import JointShard, TorusSchedule, finished
from .ulysses import gather_heads, peer_lens, scatter_heads
from .volume import peer_bytes

__all__ = ["run_layer"]


@dataclass(frozen=True)
class Plan:
    """What one sp_attention call of a given shape runs, worked out (and checked, agreed between the ranks) at the
    first call of that shape and kept by the context: every later call of the shape only looks it up."""

    lens: list[int]  # every rank's slice length
    mesh: Mesh
    kernel: str
    peer_bytes: int  # the most any peer sends this rank (Transport.begin_layer)
    signature: tuple  # what every rank knows alike about the call (the kernel choice's agreement key)
    sp: Group  # this rank's SP group
    all_at_once: bool  # T = R = 1: one attention call over every key (_all_keys_at_once)


def plan_of(ctx: ParallelContext, q: Tensor, k: Tensor, v: Tensor, joint: tuple[Tensor | None, ...],
            seq_lens: Sequence[int] | None) -> Plan:
    """The context's plan for this call's shapes: built, checked and agreed once per shape (collectively, at its
    first call), looked up after."""
    given = (joint[0] is not None) + (joint[1] is not None) + (joint[2] is not None)
    if given not in (0, 3):
        return _make_plan(ctx, q, k, v, joint, seq_lens)  # refused there, naming the fix
    key = (q.shape, k.shape, v.shape, q.dtype, q.device, None if given == 0 else
           (joint[0].shape, joint[1].shape, joint[2].shape, joint[0].dtype),
           None if seq_lens is None else tuple(seq_lens))
    plan = ctx.plans.get(key)
    if plan is None:
        plan = ctx.plans[key] = _make_plan(ctx, q, k, v, joint, seq_lens)
    return plan


def _make_plan(ctx: ParallelContext, q: Tensor, k: Tensor, v: Tensor, joint: tuple[Tensor | None, ...],
               seq_lens: Sequence[int] | None) -> Plan:
    lens = agreed_seq_lens(ctx, q, k, v, joint, seq_lens)  # every rank agrees on the shapes
    b, _, heads, d = q.shape
    joint_len = joint[0].shape[1] if joint[0] is not None else 0
    mesh, kernel = ctx.attention_plan(q, lens, joint_len)  # method "auto" chooses here
    layout = mesh.layout
    volume = peer_bytes(layout, lens, b, heads, d, joint_len, q.element_size())
    signature = ("sp_attention", layout, tuple(lens), joint_len, b, heads, d, q.dtype)
    return Plan(lens, mesh, kernel, volume, signature, ctx.cfg.sp, layout.torus == 1 and layout.ring == 1)


def run_layer(q: Tensor, k: Tensor, v: Tensor, ctx: ParallelContext, *, joint_q: Tensor | None = None,
              joint_k: Tensor | None = None, joint_v: Tensor | None = None,
              seq_lens: Sequence[int] | None = None, scale: float | None = None,
              key_mask: Tensor | None = None, joint_key_mask: Tensor | None = None
              ) -> Tensor | tuple[Tensor, Tensor]:
    """`sp_attention`, eagerly: its arguments and results (attention/__init__.py)."""
    plan = plan_of(ctx, q, k, v, (joint_q, joint_k, joint_v), seq_lens)
    masks = None
    if key_mask is not None:
        if not plan.all_at_once:
            raise ValueError(f"key masks (a batch of prompts of different lengths) need every key at once on each "
                             f"rank, after one all-to-all: method='ulysses' (U = P), not {plan.mesh.layout}")
        masks = (key_mask, joint_key_mask)
    mesh, kernel, lens, transport = plan.mesh, ctx.kernel_now(plan.kernel), plan.lens, ctx.transport
    transport.begin_layer(plan.peer_bytes)
    shard = joint_shard(joint_q, joint_k, joint_v, mesh) if joint_q is not None else None
    fault: Exact = ctx.fault or EXACT  # verify --self-test's injected fault (attention/faults.py)
    try:
        with agreed_choices(ctx.kernels, plan.sp, plan.signature, q, kernel):  # the same kernel on every rank
            if plan.all_at_once:
                out, shard = _all_keys_at_once(q, k, v, shard, mesh, transport, lens, scale, kernel, fault, masks)
            else:
                xq, xk, xv = scatter_heads((q, k, v), mesh, transport, lens)
                out = TorusSchedule(xq, xk, xv, mesh, transport, lens, shard, scale, kernel, fault).run()
        out = fault.output(gather_heads(out, mesh, transport, lens), plan.sp.index)
        joint_out = gather_joint(shard, joint_q, mesh, transport) if shard is not None else None
    finally:
        transport.end_layer()  # also on an error: every transfer the layer posted is over before it propagates
    return out if joint_out is None else (out, joint_out)


def _all_keys_at_once(q: Tensor, k: Tensor, v: Tensor, shard: JointShard | None, mesh: Mesh,
                      transport: Transport, lens: Sequence[int], scale: float | None, kernel: str, fault: Exact,
                      masks: tuple[Tensor, Tensor | None] | None = None) -> tuple[list[Tensor], JointShard | None]:
    """T = 1, R = 1 (Ulysses, USP without ring): after the all-to-all every query sees every key, so the joint
    tokens (all their rows, this rank's heads) ride in front of the sequence in the same buffers, as xDiT's
    USP puts them, and one attention call covers every row: no key concatenation, no separate small call for
    the joint queries. masks: (this rank's rows', the joint rows') key masks, [B, L] (True: attend), gathered
    over the Ulysses peers into the order the keys arrive in. Returns the sequence rows' output and the joint
    shard, finished."""
    front = (shard.q, shard.k, shard.v) if shard is not None else ()
    if len(mesh.ulysses_peers) == 1 and not front:
        # one rank holds every key (P = 1): nothing to move, nothing to merge. q, k, v go to the kernel as they
        # lie, views included (Flux.2's fused QKV+MLP projection hands out strided ones): "auto" then times SDPA
        # without log-sum-exp (its fastest backend, which diffusers' own call also takes on Hopper) against the
        # fused kernel per shape, so P = 1 costs at most what plain diffusers costs
        xq, xk, xv = q, k, v
    else:
        xq, xk, xv = scatter_heads((q, k, v), mesh, transport, lens, front)
        xq, xk, xv = xq[0], xk[0], xv[0]
    skip = shard.q.shape[1] if shard is not None else 0
    keys = fault.keys(0, [(xk, xv)], skip)
    if masks is not None:
        rows, joint = masks
        key_mask = gather(rows, peer_lens(mesh, lens), mesh.ulysses_intra.pg, dim=1)
        if joint is not None:
            key_mask = torch.cat([joint, key_mask], dim=1)
        out = attend_masked(xq, keys[0][0], keys[0][1], key_mask, scale)
    else:
        partial = Partial()
        attend_chunks([partial], [xq], keys, scale, kernel, finalize=True)
        out = finished(partial, xq)
    if shard is None:
        return [out], None
    return [out[:, skip:]], JointShard(shard.q, shard.k, shard.v, Partial(out[:, :skip], None, True))
