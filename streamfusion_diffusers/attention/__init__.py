"""`sp_attention`: exact softmax attention over a sequence split across ranks, by any of the five methods.

Eager calls run the layer directly (`layer.run_layer`); under torch.compile the call becomes the custom op
`streamfusion::sp_attention` (`op.py`), so a parallelized transformer compiles with `fullgraph=True`.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..context import ParallelContext
from .layer import run_layer
from .op import sp_attention_op

__all__ = ["sp_attention"]


def sp_attention(q: Tensor, k: Tensor, v: Tensor, ctx: ParallelContext, *, joint_q: Tensor | None = None,
                 joint_k: Tensor | None = None, joint_v: Tensor | None = None,
                 seq_lens: Sequence[int] | None = None, scale: float | None = None,
                 key_mask: Tensor | None = None, joint_key_mask: Tensor | None = None
                 ) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of this rank's query rows over the whole sequence [joint tokens ; slice 0 ; ... ; slice P-1].

    q, k, v: [B, L_local, H, D], rank i holding the i-th slice. seq_lens: every rank's slice length when they
    differ (None: all equal). joint_q/k/v: [B, L_joint, H, D], the same on every rank. scale: default
    1/sqrt(D). key_mask / joint_key_mask: [B, L_local] / [B, L_joint] bool, False for keys no query attends
    (padded prompts); only where every rank attends all keys at once (Ulysses), eager. Returns the output for the
    local rows, and with joint tokens also the joint rows' output.
    """
    if not torch.compiler.is_compiling():
        return run_layer(q, k, v, ctx, joint_q=joint_q, joint_k=joint_k, joint_v=joint_v, seq_lens=seq_lens,
                         scale=scale, key_mask=key_mask, joint_key_mask=joint_key_mask)
    if key_mask is not None:
        raise ValueError("key masks (padded prompts) under torch.compile: run the transformer eager, or pad no "
                         "prompt (one prompt per call)")
    lens = None if seq_lens is None else [int(n) for n in seq_lens]
    out, joint_out = sp_attention_op(q, k, v, ctx.handle, joint_q, joint_k, joint_v, lens, scale)
    return out if joint_q is None else (out, joint_out)
