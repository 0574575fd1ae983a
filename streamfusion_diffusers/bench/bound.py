"""The no-communication bound's attention: a rank's share (its L/P queries against all L keys) through the fastest
kernel there is for it without the log-sum-exp (cuDNN, flash or efficient SDPA, measured once per shape), so that
the bound is no slower than any method could be: our schedule needs the LSE to merge chunks, xDiT's Ulysses not.

`local_attention` is a custom op: a compiled step of the bound compiles into one graph as ours does (issue 25),
with its random keys and values made outside the graph, at the first call for a shape.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ..kernels.sdpa import attention_sdpa

# The bench process's, not a context's: the bound communicates nothing, so no ParallelContext runs it.
_keys: dict[tuple, tuple[Tensor, Tensor]] = {}  # (device, dtype, k shape) -> the bound's random K, V


def fastest_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """Attention of q over (k, v), [B, L, H, D], without the LSE, by the fastest SDPA backend for these shapes
    (kernels.sdpa.attention_sdpa: each timed once per shape; off CUDA, PyTorch's default SDPA)."""
    return attention_sdpa(q, k, v, 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale)


@torch.library.custom_op("streamfusion::local_attention", mutates_args=())
def local_attention(query: Tensor, key_len: int) -> Tensor:
    """The bound's attention for one layer: query [B, Lq, H, D] against `key_len` random keys and values that
    already lie on this rank (made at the first call for the shape, which the bench leaves untimed)."""
    shape = (query.shape[0], key_len, *query.shape[2:])
    cache = (query.device, query.dtype, shape)
    if cache not in _keys:
        _keys[cache] = (torch.randn(shape, device=query.device, dtype=query.dtype),
                        torch.randn(shape, device=query.device, dtype=query.dtype))
    return fastest_attention(query, *_keys[cache]).contiguous()


@local_attention.register_fake
def _(query: Tensor, key_len: int) -> Tensor:
    return query.new_empty(query.shape)
