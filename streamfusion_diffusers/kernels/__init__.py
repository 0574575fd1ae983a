"""Attention kernels: attention with log-sum-exp on local chunks, and the merge of partial results.

Algorithms only call `attend_chunks`, so a fused multi-chunk kernel (paper Algorithm 2) can replace the
launch-then-merge loop without touching any schedule.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .merge import merge_into
from .reference import attention_with_lse_reference
from .sdpa import attention_with_lse_sdpa

__all__ = ["Partial", "attention_with_lse", "attend_chunks", "merge_into"]


def attention_with_lse(
    q: Tensor, k: Tensor, v: Tensor, scale: float | None = None, kernel: str = "auto"
) -> tuple[Tensor, Tensor]:
    """Attention of q over (k, v) in [B, L, H, D] layout, returning (out, lse [B, H, Lq] float32).

    kernel "auto" takes PyTorch's fused SDPA for half precision on CUDA and the float32 reference otherwise.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if kernel == "sdpa" or (kernel == "auto" and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)):
        return attention_with_lse_sdpa(q, k, v, scale)
    return attention_with_lse_reference(q, k, v, scale)


@dataclass
class Partial:
    """Running attention state of one block of query rows: output normalised so far, and its LSE."""

    out: Tensor | None = None
    lse: Tensor | None = None

    def add(self, out: Tensor, lse: Tensor) -> None:
        if self.out is None:
            acc = torch.float64 if out.dtype == torch.float64 else torch.float32
            self.out, self.lse = out.to(acc), lse.to(acc)
        else:
            merge_into(self.out, self.lse, out, lse)

    def result(self, dtype: torch.dtype) -> Tensor:
        if self.out is None:
            raise RuntimeError("attention state was never updated: no key/value block reached these queries")
        return self.out.to(dtype)


def attend_chunks(
    partials: Sequence[Partial],
    q_chunks: Sequence[Tensor],
    kv_chunks: Sequence[tuple[Tensor, Tensor]],
    scale: float | None = None,
    kernel: str = "auto",
) -> None:
    """Attend every query chunk to every key/value chunk and merge into its Partial (Algorithm 2's contract)."""
    for partial, q in zip(partials, q_chunks, strict=True):
        if q.shape[1] == 0:
            continue
        for k, v in kv_chunks:
            if k.shape[1] == 0:
                continue
            partial.add(*attention_with_lse(q, k, v, scale, kernel))
