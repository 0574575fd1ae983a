"""`sp_attention` as a torch custom op, so that `torch.compile(fullgraph=True)` traces a parallelized transformer
as one graph (diffusers' recipe: `compile_repeated_blocks(fullgraph=True)` or the whole model).

The compiler sees one opaque call with known output shapes (the fake below); the transfers, the schedule's Python,
the kernel choice and the transport's streams run inside it exactly as in eager mode. A custom op takes no Python
object, so the ParallelContext travels as its integer `handle` (Dynamo guards on it like any constant).
"""
from __future__ import annotations

import torch
from torch import Tensor

from ..context import context_of
from .layer import run_layer

__all__ = ["sp_attention_op"]


@torch.library.custom_op("streamfusion::sp_attention", mutates_args=())
def sp_attention_op(q: Tensor, k: Tensor, v: Tensor, handle: int, joint_q: Tensor | None, joint_k: Tensor | None,
                    joint_v: Tensor | None, seq_lens: list[int] | None, scale: float | None
                    ) -> tuple[Tensor, Tensor]:
    """`run_layer` for the context `handle`: (local rows' output, joint rows' output, [B, 0, H, D] without joint
    tokens), both contiguous and fresh, as the fake promises and custom ops require (no output aliases another)."""
    result = run_layer(q, k, v, context_of(handle), joint_q=joint_q, joint_k=joint_k, joint_v=joint_v,
                       seq_lens=seq_lens, scale=scale)
    out, joint_out = result if joint_q is not None else (result, _no_rows(q))
    out = out.contiguous()
    if joint_out.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
        joint_out = joint_out.clone()  # T = R = 1: joint rows and local rows are views of one attention output
    return out, joint_out.contiguous()


@sp_attention_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, handle: int, joint_q: Tensor | None, joint_k: Tensor | None,
      joint_v: Tensor | None, seq_lens: list[int] | None, scale: float | None) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape), (_no_rows(q) if joint_q is None else joint_q.new_empty(joint_q.shape))


def _no_rows(q: Tensor) -> Tensor:
    return q.new_empty((q.shape[0], 0, *q.shape[2:]))
