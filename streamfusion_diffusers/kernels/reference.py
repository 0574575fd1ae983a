"""Float32 reference attention with log-sum-exp: the CPU kernel and the ground truth for GPU kernels."""
from __future__ import annotations

import torch
from torch import Tensor


def attention_with_lse_reference(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Softmax attention of q [B, Lq, H, D] over k, v [B, Lk, H, D], computed in float32 (or float64 if given).

    Returns the normalised output [B, Lq, H, D] in the compute dtype and the natural-log LSE [B, H, Lq].
    """
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
    return out, lse
