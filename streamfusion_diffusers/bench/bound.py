"""The no-communication bound's attention: a rank's share (its L/P queries against all L keys) through the fastest
kernel there is for it without the log-sum-exp (cuDNN, flash or efficient SDPA, measured once per shape), so that
the bound is no slower than any method could be: our schedule needs the LSE to merge chunks, xDiT's Ulysses not.

`local_attention` is a custom op: a compiled step of the bound compiles into one graph as ours does (issue 25),
with its random keys and values made outside the graph, at the first call for a shape.
"""
from __future__ import annotations

import logging
import math

import torch
from torch import Tensor

from ..core.logs import say_once
from ..kernels.dispatch import time_ms
from ..kernels.sdpa import BACKENDS, attention_no_lse, attention_sdpa

logger = logging.getLogger(__name__)

# The bench process's, not a context's: the bound communicates nothing, so no ParallelContext runs it.
_fastest: dict[tuple, str] = {}  # (device, dtype, q shape, k shape) -> SDPA backend
_keys: dict[tuple, tuple[Tensor, Tensor]] = {}  # (device, dtype, k shape) -> the bound's random K, V


def fastest_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """Attention of q over (k, v), [B, L, H, D], without the LSE, by the fastest SDPA kernel for these shapes
    (off CUDA, PyTorch's default SDPA)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if not q.is_cuda:
        return attention_sdpa(q, k, v, scale)
    key = (q.device, q.dtype, tuple(q.shape), tuple(k.shape))
    if key not in _fastest:
        times = {}
        for backend in BACKENDS:
            try:
                times[backend] = time_ms(lambda: None, lambda _, b=backend: attention_no_lse(b, q, k, v, scale))
            except RuntimeError:  # this kernel does not take the shape or dtype
                continue
        _fastest[key] = min(times, key=times.get)
        say_once(logger, logging.INFO, "no-comm bound for q %s, k %s: %s without LSE (%s ms)", tuple(q.shape),
                 tuple(k.shape), _fastest[key], ", ".join(f"{b} {t:.3f}" for b, t in times.items()))
    return attention_no_lse(_fastest[key], q, k, v, scale)


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
