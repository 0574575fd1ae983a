"""Attention of queries every rank holds whole over keys split across the ranks (LTX-2's audio attending the video).

Each rank attends the whole queries to its own keys and values, and the partial outputs, with their log-sum-exp,
are gathered and merged in rank order: exact, the same result on every rank, and what moves is the queries'
output (P copies of it), not the split keys and values, which are the far longer stream.
"""
from __future__ import annotations

from torch import Tensor

from ..context import ParallelContext
from ..core.sequence import gather
from ..kernels.attend import attention_with_lse
from ..kernels.partial import Partial


def split_key_attention(q: Tensor, k: Tensor, v: Tensor, ctx: ParallelContext, scale: float | None = None
                        ) -> Tensor:
    """q: [B, Lq, H, D], the same on every rank; k, v: [B, L_local, H, D], this rank's slice of the keys. Returns
    the output of the queries over every rank's keys, [B, Lq, H, D] in q's dtype."""
    out, lse = attention_with_lse(q, k, v, scale)
    group = ctx.cfg.sp
    ones = [1] * group.size
    outs, lses = gather(out.unsqueeze(0), ones, group.pg, dim=0), gather(lse.unsqueeze(0), ones, group.pg, dim=0)
    merged = Partial()
    for rank in range(group.size):  # rank order on every rank: bit for bit the same merge everywhere
        merged.add(outs[rank], lses[rank])
    return merged.result(q.dtype)


__all__ = ["split_key_attention"]
