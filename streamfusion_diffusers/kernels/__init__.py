"""Attention kernels: attention with log-sum-exp on local chunks, and the merge of partial results.

Algorithms only call `Partial`, `Partial.result` and `attend_chunks`, so the kernel behind them is chosen
here: "reference" (float32 torch, any device), "sdpa" (PyTorch's cuDNN/flash SDPA + a one-pass merge per
chunk pair), "fused" (one launch for all chunks, merge in the kernel: paper Algorithm 2; Gluon on Hopper, Triton
elsewhere: fused.py) or "auto"
(reference off CUDA, else the faster of sdpa and fused for the call's shape, measured once and cached in the
context's KernelState, state.py; inside `agreed_choices` every rank of the layer picks the same: see dispatch.py).
Queries that see every key at once (one query chunk, one key chunk, no state: P = 1, or Ulysses after its
all-to-all) below FUSED_MIN_WORK take sdpa untimed: the fused kernel has lost every such shape measured
(BENCHMARKS.md, the kernel tables; it gains where it saves launches and merges, many chunks in one call), and
timing it there costs its compile (seconds per variant on a cold Triton cache) in a job's first step for nothing.
"""
from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.mesh import Group
from . import dispatch
from .chunk_tables import aligned
from .inputs import check_chunks, check_state
from .merge import merge_into
from .optional import has_triton
from .reference import attention_with_lse_reference
from .sdpa import attention_masked, attention_sdpa, attention_with_lse_sdpa
from .state import KernelState, owned_by

__all__ = ["KernelState", "Partial", "agreed_choices", "attention_with_lse", "attend_chunks", "attend_masked",
           "merge_into"]

_HALF = (torch.float16, torch.bfloat16)
FUSED_MIN_WORK = 25e6  # queries x keys per head of a whole-keys call below which auto takes sdpa


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
        _check_fused(q)
        partial = Partial()
        _attend_fused([(partial, q)], [(k, v)], scale, finalize=True)
        return partial.out, partial.lse
    if kernel == "sdpa" or (kernel == "auto" and q.is_cuda and q.dtype in _HALF):
        return attention_with_lse_sdpa(q, k, v, scale)
    return attention_with_lse_reference(q, k, v, scale)


@dataclass
class Partial:
    """Running attention state of one block of query rows: the paper's (O', l, m) kept normalised, as
    out = O'/l (float32, contiguous [B, Lq, H, D]) and lse = m + ln l (float32 [B, H, Lq]).

    Once finalized, `out` holds the final output in the query dtype and no more chunks can be added.
    """

    out: Tensor | None = None
    lse: Tensor | None = None
    final: bool = False

    def add(self, out: Tensor, lse: Tensor) -> None:
        """Merge one chunk pair's (out, lse) into the state."""
        if self.final:
            raise RuntimeError("this attention state was finalized; no more key/value chunks can be merged")
        if self.out is None:
            acc = torch.float64 if out.dtype == torch.float64 else torch.float32
            self.out = torch.empty(out.shape, dtype=acc, device=out.device).copy_(out)
            self.lse = torch.empty(lse.shape, dtype=acc, device=lse.device).copy_(lse)
        else:
            merge_into(self.out, self.lse, out, lse)

    def finalize(self, dtype: torch.dtype) -> None:
        """Keep only the output, cast to dtype."""
        if self.out is not None:
            self.out = self.out.to(dtype)
            self.final = True

    def result(self, dtype: torch.dtype) -> Tensor:
        if self.out is None:
            raise RuntimeError("attention state was never updated: no key/value block reached these queries")
        return self.out.to(dtype)

    def clone(self) -> Partial:
        return Partial(None if self.out is None else self.out.clone(),
                       None if self.lse is None else self.lse.clone(), self.final)


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
    path = _choose_path(kernel, pairs, kv, scale, finalize)
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


Pairs = Sequence[tuple[Partial, Tensor]]
KV = Sequence[tuple[Tensor, Tensor]]


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


def _choose_path(kernel: str, pairs: Pairs, kv: KV, scale: float, finalize: bool) -> str:
    """Resolve "auto" to reference, sdpa or fused; a forced kernel is checked and kept."""
    q = pairs[0][1]
    if kernel == "fused":
        _check_fused(q)
        return "fused"
    if kernel != "auto":
        return kernel
    if not (q.is_cuda and q.dtype in _HALF):
        return "reference"
    if not (has_triton() and _fused_supports(q)):
        return "sdpa"
    # loops, not comprehensions, and the candidates made only where the shape is new: this runs at every call
    load_state, q_lens, kv_lens = False, [], []
    for p, x in pairs:
        if not aligned(x):
            return "sdpa"
        load_state |= p.out is not None
        q_lens.append(x.shape[1])
    for k, v in kv:
        if not (aligned(k) and aligned(v)):
            return "sdpa"
        kv_lens.append(k.shape[1])
    if finalize and not load_state and len(q_lens) == len(kv_lens) == 1 and q_lens[0] * kv_lens[0] < FUSED_MIN_WORK:
        return "sdpa"
    b, _, h, d = q.shape
    key = (q.device, q.dtype, b, h, d, tuple(q_lens), tuple(kv_lens), load_state, finalize)

    def candidates() -> dispatch.Candidates:
        def prepare() -> list[tuple[Partial, Tensor]]:
            return [(p.clone(), x) for p, x in pairs]

        return {"sdpa": (prepare, lambda s: _attend_unfused(s, kv, scale, finalize, "sdpa")),
                "fused": (prepare, lambda s: _attend_fused(s, kv, scale, finalize))}

    return dispatch.choose(key, candidates)


def agreed_choices(state: KernelState, group: Group, signature: Hashable, q: Tensor, kernel: str
                   ) -> AbstractContextManager:
    """Scope of one sp_attention layer call (signature: what every rank knows alike about it): its kernels keep
    what they keep in `state` (its context's), and its "auto" choices every rank of `group` shares (see
    dispatch.py); no agreement where no choice is measured: a named kernel, pinned choices, or no fused candidate
    for q's device, dtype and head dim (the same on every rank)."""
    if kernel == "auto" and q.is_cuda and has_triton() and _fused_supports(q) and not dispatch.pinned():
        return dispatch.layer(signature, group, state)
    return owned_by(state)


def _check_fused(q: Tensor) -> None:
    if not (has_triton() and _fused_supports(q)):
        raise ValueError(f"kernel 'fused' needs triton and float16/bfloat16 inputs with head dim 64 or 128 "
                         f"(got {q.dtype}, head dim {q.shape[-1]}); use kernel='auto'")


def _fused_supports(q: Tensor) -> bool:
    return q.dtype in _HALF and q.shape[-1] in (64, 128)
