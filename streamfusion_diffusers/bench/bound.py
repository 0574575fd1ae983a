"""The two bounds a timed row is held against, and "x bound", its time over the larger.

Compute: the no-communication bound's attention, a rank's share (its L/P queries against all L keys) through the
fastest kernel there is for it: SDPA without the log-sum-exp by its fastest backend (cuDNN, flash or efficient), or
our fused kernel where it is faster (long sequences, as at Wan's and CogVideoX's), each timed once per shape, so
that the bound is no slower than any method could be: our schedule needs the LSE to merge chunks, xDiT's Ulysses
not. Link: over an emulated link, the time the busiest rank's inter-machine bytes and messages take on it alone
(choice/costmodel.py's link_bound, the volumes the emulated transport counts), whatever overlaps them.

`local_attention` is a custom op: a compiled step of the bound compiles into one graph as ours does,
with its random keys and values made outside the graph, at the first call for a shape.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from ..choice.costmodel import link_bound
from ..choice.workloads import Workload
from ..core.links import parse_link
from ..kernels.attend import attend_chunks
from ..kernels.partial import Partial
from ..kernels.sdpa import attention_sdpa

# The bench process's, not a context's: the bound communicates nothing, so no ParallelContext runs it.
_keys: dict[tuple, tuple[Tensor, Tensor]] = {}  # (device, dtype, k shape) -> the bound's random K, V


def fastest_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """Attention of q over (k, v), [B, L, H, D], by the fastest kernel for these shapes: the kernels' "auto"
    choice for one chunk with nothing to merge after it, SDPA without the LSE (kernels.sdpa.attention_sdpa) against
    the fused kernel, each timed once per shape; off CUDA, PyTorch's default SDPA."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if not q.is_cuda:
        return attention_sdpa(q, k, v, scale)
    partial = Partial()
    attend_chunks([partial], [q], [(k, v)], scale, "auto", finalize=True)
    return partial.result(q.dtype)


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


def link_bound_ms(ctx, w: Workload, itemsize: int, layers: int = 1) -> float | None:
    """The link bound of `layers` attention layers of `w` as context `ctx` of ours ran them (method auto: the
    least over the layouts it chose), in ms. None where no link bounds the row: no emulated link, or no context
    (the no-comm bound, and the baselines, whose transfers do not go through the emulated link), or 1-byte
    transfers (comm_dtype: the volumes are the dtype's)."""
    if ctx is None or ctx.config.emulate_link is None or ctx.config.comm_dtype is not None:
        return None
    link = parse_link(ctx.config.emulate_link)
    if ctx.config.method == "auto":
        ran = {c.layout for key, c in ctx.chosen.items() if key[1] == w.heads}
    else:
        ran = {ctx.layout(w.heads)}
    return layers * min(link_bound(lay, w, link, itemsize).seconds for lay in ran) * 1e3


def over_bounds(ms: float, compute_ms: float | None, link_ms: float | None) -> float | None:
    """ "x bound": a time over the larger of the bounds the row has (None: neither)."""
    bounds = [b for b in (compute_ms, link_ms) if b]
    return ms / max(bounds) if bounds else None
