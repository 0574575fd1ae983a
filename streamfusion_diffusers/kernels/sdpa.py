"""GPU attention with log-sum-exp through PyTorch's fused SDPA kernels (cuDNN, then flash, then efficient).

Each aten op returns the natural-log LSE as float32 [B, H, Lq] (the efficient kernel pads Lq to a multiple
of 32, older cuDNN builds add a trailing dim of 1): the result is cut back to [B, H, Lq].
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.logs import say_once

logger = logging.getLogger(__name__)

BACKENDS = ("cudnn", "flash", "efficient")
_failed: set[str] = set()  # what this process's torch build and GPU cannot run: a capability, not a choice


def _call(backend: str, q: Tensor, k: Tensor, v: Tensor, scale: float, lse: bool = True) -> tuple[Tensor, Tensor]:
    """q, k, v in [B, H, L, D]; returns the op's raw (out, lse); lse=False asks for none where the kernel can skip
    it (cuDNN, efficient: flash always writes it) and returns an undefined one."""
    aten = torch.ops.aten
    if backend == "cudnn":
        res = aten._scaled_dot_product_cudnn_attention(q, k, v, None, lse, 0.0, False, False, scale=scale)
    elif backend == "flash":
        res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
    else:
        res = aten._scaled_dot_product_efficient_attention(q, k, v, None, lse, 0.0, False, scale=scale)
    return res[0], res[1]


def attention_no_lse(backend: str, q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """q [B, Lq, H, D], k, v [B, Lk, H, D] -> out [B, Lq, H, D] by one named SDPA backend, without the
    log-sum-exp: what a rank's share costs with no merge to feed (the bench's no-communication bound)."""
    out, _ = _call(backend, *(x.transpose(1, 2) for x in (q, k, v)), scale, lse=False)
    return out.transpose(1, 2)


def attention_sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """q [B, Lq, H, D], k, v [B, Lk, H, D] -> out [B, Lq, H, D]: PyTorch's default fused SDPA, no log-sum-exp
    (for queries that need no merge; faster than the LSE variants at long sequences)."""
    return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), scale=scale).transpose(1, 2)


def attention_with_lse_sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float,
                            backends: Sequence[str] = BACKENDS) -> tuple[Tensor, Tensor]:
    """q [B, Lq, H, D], k, v [B, Lk, H, D] on CUDA -> (out [B, Lq, H, D] in q.dtype, lse [B, H, Lq] float32).

    Tries the given backends in order; one that rejects a shape or dtype is skipped from then on (said once).
    Running out of memory is not a rejection: it is raised, with the sizes, and every backend stays usable.
    """
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    for backend in backends:
        if backend in _failed:
            continue
        try:
            out, lse = _call(backend, qt, kt, vt, scale)
        except torch.OutOfMemoryError as err:
            raise torch.OutOfMemoryError(
                f"SDPA backend {backend} ran out of GPU memory for attention of {q.shape[1]} queries over "
                f"{k.shape[1]} keys ({q.shape[0]} x {q.shape[2]} heads of {q.shape[3]}, {q.dtype}): spread the "
                f"sequence over more ranks (a longer ring holds less K/V), lower the batch, or free memory "
                f"first ({err})") from err
        except RuntimeError as err:
            _failed.add(backend)
            say_once(logger, logging.WARNING, "SDPA backend %s unavailable (%s); falling back to the next one",
                     backend, err)
            continue
        if lse.dim() == 4:
            lse = lse.squeeze(-1)
        return out.transpose(1, 2), lse[..., : q.shape[1]].float()
    raise RuntimeError(f"no SDPA backend of {list(backends)} returned the log-sum-exp for this input; "
                       "use kernel='reference'")
