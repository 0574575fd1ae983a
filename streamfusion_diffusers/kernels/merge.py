"""Log-sum-exp merge of partial attention results (paper Appendix C, eq. 2, in its normalised form).

With each partial normalised by its own softmax sum (O_i = O'_i / l_i, lse_i = m_i + ln l_i), merging is
O = sum_i exp(lse_i - lse) O_i with lse = logaddexp_i(lse_i). On CUDA one Triton pass reads both partials
and writes the running one in place; elsewhere (and as the reference that CI tests) it is plain torch.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .optional import has_triton


def merge_into_reference(out: Tensor, lse: Tensor, new_out: Tensor, new_lse: Tensor) -> None:
    """Fold one partial result into a running one, in place, with torch ops (any device).

    out, new_out: [B, Lq, H, D]; lse, new_lse: [B, H, Lq]; out and lse are float32 (or float64) accumulators.
    """
    new_lse = new_lse.to(lse.dtype)
    total = torch.logaddexp(lse, new_lse)
    w_old = torch.exp(lse - total).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(new_lse - total).transpose(1, 2).unsqueeze(-1)
    out.mul_(w_old).add_(new_out.to(out.dtype) * w_new)
    lse.copy_(total)


def merge_into(out: Tensor, lse: Tensor, new_out: Tensor, new_lse: Tensor) -> None:
    """Fold (new_out, new_lse) into the running (out, lse) in place: one fused pass on CUDA, torch elsewhere.

    The fused pass needs out float32 contiguous [B, Lq, H, D] and lse float32 contiguous [B, H, Lq];
    new_out and new_lse may be strided views (as SDPA returns them), and the head dim a power of two.
    """
    fused = (out.is_cuda and has_triton() and out.dtype == torch.float32 and lse.dtype == torch.float32
             and out.is_contiguous() and lse.is_contiguous() and new_out.stride(-1) == 1
             and out.shape[-1] & (out.shape[-1] - 1) == 0)
    if fused:
        from .triton_merge import merge_into_triton

        merge_into_triton(out, lse, new_out, new_lse)
    else:
        merge_into_reference(out, lse, new_out, new_lse)
