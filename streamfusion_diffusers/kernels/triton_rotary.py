"""Flux's rotary embedding of Q and K in one Triton pass, rounded as diffusers rounds it.

diffusers' `apply_rotary_emb` (real tables, interleaved channel pairs) computes x * cos + rotate(x) * sin in
float32 and casts back: torch runs that as about eight passes over each tensor (the pair split, the rotated
stack, two upcasts, two products, the sum, the cast) at every block. Here one program reads a block of rows of
Q and K once and writes them once. Each product and the sum are rounded on their own, as torch rounds them
(the launch turns fused multiply-adds off), so the result is diffusers', bit for bit.
"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rotate(x_ptr, out_ptr, even, ok, c0, c1, s0, s1):
    """One tensor's block: channel pairs (x0, x1) -> (x0 cos0 - x1 sin0, x1 cos1 + x0 sin1)."""
    x0 = tl.load(x_ptr + even, mask=ok, other=0.0).to(tl.float32)
    x1 = tl.load(x_ptr + even + 1, mask=ok, other=0.0).to(tl.float32)
    o0 = x0 * c0 + (-x1) * s0
    o1 = x1 * c1 + x0 * s1
    tl.store(out_ptr + even, o0.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(out_ptr + even + 1, o1.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, q_out, k_out, cos_ptr, sin_ptr, rows, heads, seq,
                   HALF: tl.constexpr, BLOCK_R: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # row (b * seq + s) * heads + h of [B, S, H, D]
    ok = (r < rows)[:, None]
    pair = 2 * tl.arange(0, HALF)[None, :]
    even = r.to(tl.int64)[:, None] * (2 * HALF) + pair
    table = ((r // heads) % seq)[:, None] * (2 * HALF) + pair  # the row's position in the [S, D] tables
    c0 = tl.load(cos_ptr + table, mask=ok, other=0.0)
    c1 = tl.load(cos_ptr + table + 1, mask=ok, other=0.0)
    s0 = tl.load(sin_ptr + table, mask=ok, other=0.0)
    s1 = tl.load(sin_ptr + table + 1, mask=ok, other=0.0)
    _rotate(q_ptr, q_out, even, ok, c0, c1, s0, s1)
    _rotate(k_ptr, k_out, even, ok, c0, c1, s0, s1)


def rotary_qk_triton(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """q, k contiguous [B, S, H, D] of one dtype, D / 2 a power of two; cos, sin contiguous float32 [S, D]."""
    batch, seq, heads, dim = q.shape
    q_out, k_out = q.new_empty(q.shape), k.new_empty(k.shape)
    rows = batch * seq * heads
    block_r = max(1, 2048 // dim)
    _rotary_kernel[(triton.cdiv(rows, block_r),)](q, k, q_out, k_out, cos, sin, rows, heads, seq,
                                                  HALF=dim // 2, BLOCK_R=block_r, num_warps=4,
                                                  enable_fp_fusion=False)
    return q_out, k_out
