"""The attention entry points the algorithms call: `attend_chunks` (query chunks against key/value chunks,
merged into each query block's Partial), `attend_masked` (a key mask, finished at once) and
`attention_with_lse` (one call, its log-sum-exp returned).

Which kernel runs a call is choice.py's; here each runs: one launch per chunk pair merged into the state
(sdpa, reference), or every pair in one fused launch (fused.py).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from . import dispatch
from .choice import HALF, KV, QUANTIZED, Pairs, check_fused, check_quantized, kernel_for
from .inputs import check_chunks, check_state
from .partial import Partial
from .reference import attention_with_lse_reference
from .sdpa import attention_masked, attention_sdpa, attention_with_lse_sdpa


def attention_with_lse(
    q: Tensor, k: Tensor, v: Tensor, scale: float | None = None, kernel: str = "auto"
) -> tuple[Tensor, Tensor]:
    """Attention of q over (k, v) in [B, L, H, D] layout, returning (out, lse [B, H, Lq] float32).

    kernel "auto" takes PyTorch's fused SDPA for half precision on CUDA and the float32 reference otherwise.
    Inputs no kernel computes (no keys or queries, mismatched shapes) are refused first (inputs.check_chunks).
    """
    check_chunks([q], [(k, v)])
    return _with_lse(q, k, v, 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale, kernel)


def _with_lse(q: Tensor, k: Tensor, v: Tensor, scale: float, kernel: str) -> tuple[Tensor, Tensor]:
    """`attention_with_lse` of inputs already checked (attend_chunks checks its chunks once for every pair)."""
    if kernel == "fused":
        check_fused(q)
        partial = Partial()
        _attend_fused([(partial, q)], [(k, v)], scale, finalize=True)
        return partial.out, partial.lse
    if kernel in QUANTIZED:
        from .quantized_attention import attention_with_lse_quantized  # triton: imported only where it runs

        check_quantized(kernel, q)
        return attention_with_lse_quantized(q, k, v, scale, kernel)
    if kernel == "sdpa" or (kernel == "auto" and q.is_cuda and q.dtype in HALF):
        return attention_with_lse_sdpa(q, k, v, scale)
    return attention_with_lse_reference(q, k, v, scale)


def attend_chunks(
    partials: Sequence[Partial],
    q_chunks: Sequence[Tensor],
    kv_chunks: Sequence[tuple[Tensor, Tensor]],
    scale: float | None = None,
    kernel: str = "auto",
    finalize: bool = False,
) -> None:
    """Attend every query chunk to every key/value chunk and merge into its Partial (Algorithm 2's contract).

    finalize: these are the last key/value chunks for these queries, so each Partial keeps only its output
    in the query dtype (the fused kernel writes it directly instead of a float32 state).
    """
    dispatch.count_call()  # every call, even one with nothing to do, so call positions match across ranks
    pairs, queries, kv = [], [], []  # loops, not comprehensions: this runs at every attention call
    for p, q in zip(partials, q_chunks, strict=True):
        if q.shape[1] > 0:
            pairs.append((p, q))
            queries.append(q)
    for k, v in kv_chunks:
        if k.shape[1] > 0:
            kv.append((k, v))
    if not pairs:
        return
    if not kv:
        if finalize:
            for p, q in pairs:
                p.finalize(q.dtype)
        return
    check_chunks(queries, kv)  # empty chunks were skipped above: a ring step may hold none
    for p, q in pairs:
        if p.out is not None and not p.final:
            check_state(p.out, p.lse, q)
    scale = 1.0 / math.sqrt(pairs[0][1].shape[-1]) if scale is None else scale

    def candidates() -> dispatch.Candidates:
        def prepare() -> list[tuple[Partial, Tensor]]:
            return [(p.clone(), x) for p, x in pairs]

        return {"sdpa": (prepare, lambda s: _attend_unfused(s, kv, scale, finalize, "sdpa")),
                "fused": (prepare, lambda s: _attend_fused(s, kv, scale, finalize))}

    path = kernel_for(kernel, pairs, kv, finalize, candidates)
    if path == "fused":
        _attend_fused(pairs, kv, scale, finalize)
    else:
        _attend_unfused(pairs, kv, scale, finalize, path)


def attend_masked(q: Tensor, k: Tensor, v: Tensor, key_mask: Tensor, scale: float | None = None) -> Tensor:
    """Queries that see every key at once, some keys masked out ([B, Lk], True: attend): the output, finished (no
    state to merge). One kernel whatever was chosen for unmasked calls: the fused one takes no mask."""
    dispatch.count_call()  # as attend_chunks: call positions match across ranks
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return attention_masked(q, k, v, key_mask, scale)


def _attend_unfused(pairs: Pairs, kv: KV, scale: float, finalize: bool, kernel: str) -> None:
    """One attention launch per (Q, KV) chunk pair, each merged into the state by a one-pass merge.

    Queries that see every key here at once (finalize, no earlier state) take one SDPA call over the key chunks
    joined, without the log-sum-exp (nothing merges after it), by the fastest SDPA backend for the shape."""
    whole: KV = []
    for p, q in pairs:
        if finalize and p.out is None and kernel == "sdpa":
            if not whole:
                whole = kv if len(kv) == 1 else [(torch.cat([k for k, _ in kv], 1), torch.cat([v for _, v in kv], 1))]
            p.out, p.lse, p.final = attention_sdpa(q, *whole[0], scale), None, True
            continue
        if finalize and p.out is None and len(kv) == 1:
            # A single chunk pair needs no merge: keep the kernel's output as it is.
            p.out, p.lse = _with_lse(q, *kv[0], scale, kernel)
            p.out, p.final = p.out.to(q.dtype), True
            continue
        for k, v in kv:
            p.add(*_with_lse(q, k, v, scale, kernel))
        if finalize:
            p.finalize(q.dtype)


def _attend_fused(pairs: Pairs, kv: KV, scale: float, finalize: bool) -> None:
    """All chunk pairs in one launch; earlier state is loaded and merged in the kernel."""
    from .fused import multi_chunk_attention

    load_state = any(p.out is not None for p, _ in pairs)
    states, outs = [], []
    for p, q in pairs:
        if p.final:
            raise RuntimeError("this attention state was finalized; no more key/value chunks can be merged")
        if p.out is None:
            b, length, h, d = q.shape
            p.lse = torch.empty((b, h, length), dtype=torch.float32, device=q.device)
            if load_state:  # mixed with partials that have state: an empty state merges as a no-op
                p.out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
                p.lse.fill_(float("-inf"))
            elif not finalize:
                p.out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        elif p.out.dtype != torch.float32:
            raise ValueError("fused attention needs a float32 state; do not mix with float64 partials")
        states.append((p.out if load_state else None, p.lse))
        outs.append(q.new_empty(q.shape) if finalize else p.out)
    multi_chunk_attention([q for _, q in pairs], kv, states, outs, scale, finalize)
    if finalize:
        for (p, _), out in zip(pairs, outs):
            p.out, p.final = out, True
