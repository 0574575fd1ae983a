"""What every attention kernel refuses, checked once on the host at the kernels' entry, before any launch.

A kernel given no key rows has nothing to normalise by: the reference returns NaN rows without a word, SDPA
raises about something else, and the fused GPU kernels wait for a key tile that never comes (a hang). Heads,
head dims, batches, dtypes or devices that differ between q, k and v, or a running state laid out otherwise than
the kernels write it, fail as deep or as late. Here each gets one ValueError that names the input and the fix.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

import torch
from torch import Tensor


def check_chunks(q_chunks: Sequence[Tensor], kv_chunks: Sequence[tuple[Tensor, Tensor]]) -> None:
    """Every query chunk and key/value chunk [B, L, H, D] with L >= 1, of one batch, head count, head dim, dtype
    and device; a ValueError naming the first that is not. Every attention call passes here: the loop only
    compares, and the message is built once something fails."""
    if not q_chunks or not kv_chunks:
        raise ValueError(f"attention needs at least one query chunk and one key/value chunk, got {len(q_chunks)} "
                         f"and {len(kv_chunks)}")
    first = q_chunks[0]
    if first.dim() != 4:
        raise ValueError(f"attention takes q, k, v as [B, L, H, D]; q has shape {tuple(first.shape)}")
    b, _, h, d = first.shape
    dtype, device = first.dtype, first.device
    named = []
    for q in q_chunks:
        named.append(("q", q))
    for k, v in kv_chunks:
        named += (("k", k), ("v", v))
    for name, x in named:
        shape = x.shape
        if len(shape) != 4 or shape[0] != b or shape[2] != h or shape[3] != d or not shape[1] or \
                x.dtype != dtype or x.device != device:
            _refuse(name, x, first)
    for k, v in kv_chunks:
        if k.shape[1] != v.shape[1]:
            raise ValueError(f"k has {k.shape[1]} rows but v has {v.shape[1]}: each key needs its value")


def _refuse(name: str, x: Tensor, q: Tensor) -> NoReturn:
    """The ValueError for the chunk `name` that check_chunks found unlike q (or empty)."""
    b, _, h, d = q.shape
    if x.dim() != 4 or x.shape[0] != b or x.shape[2:] != (h, d):
        raise ValueError(f"attention takes q, k, v as [B, L, H, D] of one batch, head count and head dim: q is "
                         f"[{b}, L, {h}, {d}], {name} is {list(x.shape)}; repeat k/v heads for grouped-query "
                         f"attention")
    if x.dtype != q.dtype or x.device != q.device:
        raise ValueError(f"attention takes q, k, v of one dtype on one device: q is {q.dtype} on {q.device}, "
                         f"{name} is {x.dtype} on {x.device}")
    what = "queries" if name == "q" else "keys (a softmax over nothing)"
    raise ValueError(f"attention got no {what}: {name} has 0 rows; skip the call, or pass at least one row")


def check_state(out: Tensor, lse: Tensor, q: Tensor) -> None:
    """A running state as the kernels keep it: out float32 (or float64) contiguous, q's shape [B, Lq, H, D]; lse
    of out's dtype, contiguous [B, H, Lq]."""
    b, length, h, _ = q.shape
    if out.dtype not in (torch.float32, torch.float64) or lse.dtype != out.dtype:
        raise ValueError(f"an attention state is float32 (or float64): out and lse of one of them, got {out.dtype} "
                         f"and {lse.dtype}")
    if out.shape != q.shape or lse.shape != (b, h, length):
        raise ValueError(f"an attention state for q {list(q.shape)} is out {list(q.shape)} and lse [{b}, {h}, "
                         f"{length}], got {list(out.shape)} and {list(lse.shape)}")
    if not (out.is_contiguous() and lse.is_contiguous()):
        raise ValueError("an attention state must be contiguous (out [B, Lq, H, D], lse [B, H, Lq]): keep the "
                         "Partial's own tensors, or pass .contiguous() copies")


__all__ = ["check_chunks", "check_state"]
