"""`sp_attention`: exact softmax attention over a sequence split across ranks, by any of the five methods.

Every method is the same three steps on the mesh (torus T, intra-Ulysses U', ring R):
scatter heads over the intra-Ulysses group, run the Torus schedule (a single ring pass when T = 1),
gather heads back. ulysses = (1, P, 1), ring = (1, 1, P), usp/tas = (1, U, R), torus = (T, U/T, R).
"""
from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from ..context import ParallelContext
from ..recipes.choose import attention_plan
from .agreement import agreed_seq_lens
from .joint import gather_joint, joint_shard
from .torus import TorusSchedule
from .ulysses import gather_heads, scatter_heads
from .volume import peer_bytes

__all__ = ["sp_attention"]


def sp_attention(q: Tensor, k: Tensor, v: Tensor, ctx: ParallelContext, *, joint_q: Tensor | None = None,
                 joint_k: Tensor | None = None, joint_v: Tensor | None = None,
                 seq_lens: Sequence[int] | None = None, scale: float | None = None
                 ) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of this rank's query rows over the whole sequence [joint tokens ; slice 0 ; ... ; slice P-1].

    q, k, v: [B, L_local, H, D], rank i holding the i-th slice. seq_lens: every rank's slice length when they
    differ (None: all equal). joint_q/k/v: [B, L_joint, H, D], the same on every rank. scale: default
    1/sqrt(D). Returns the output for the local rows, and with joint tokens also the joint rows' output.
    """
    joint = (joint_q, joint_k, joint_v)
    lens = agreed_seq_lens(ctx, q, k, v, joint, seq_lens)  # every rank agrees on the shapes (once per shape)
    b, _, heads, d = q.shape
    joint_len = joint_q.shape[1] if joint_q is not None else 0
    mesh, kernel = attention_plan(ctx, q, lens, joint_len)  # method "auto" chooses here, once per shape
    transport = ctx.transport
    transport.begin_layer(peer_bytes(mesh.layout, lens, b, heads, d, joint_len, q.element_size()))
    xq, xk, xv = scatter_heads((q, k, v), mesh, transport, lens)
    shard = joint_shard(joint_q, joint_k, joint_v, mesh) if joint_q is not None else None
    out = TorusSchedule(xq, xk, xv, mesh, transport, lens, shard, scale, kernel).run()
    out = gather_heads(out, mesh, transport, lens)
    joint_out = gather_joint(shard, joint_q, mesh, transport) if shard is not None else None
    transport.end_layer()
    return out if joint_out is None else (out, joint_out)
