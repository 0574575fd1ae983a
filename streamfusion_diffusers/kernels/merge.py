"""Log-sum-exp merge of partial attention results (paper Appendix C, in its normalised form)."""
from __future__ import annotations

import torch
from torch import Tensor


def merge_into(out: Tensor, lse: Tensor, new_out: Tensor, new_lse: Tensor) -> None:
    """Fold one partial result into a running one, in place.

    out, new_out: [B, Lq, H, D]; lse, new_lse: [B, H, Lq]. `out` and `lse` are float32 accumulators;
    each partial is normalised by its own softmax sum, so the merge weights are exp(lse_i - lse_total).
    """
    total = torch.logaddexp(lse, new_lse.to(lse.dtype))
    w_old = torch.exp(lse - total).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(new_lse.to(lse.dtype) - total).transpose(1, 2).unsqueeze(-1)
    out.mul_(w_old).add_(new_out.to(out.dtype) * w_new)
    lse.copy_(total)
