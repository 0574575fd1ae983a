"""One-pass in-place LSE merge in Triton, for the unfused (SDPA + merge) path.

Reads the running float32 (out, lse) and the new partial once and writes the running state once: the
bytes floor of a merge, against torch's five passes (logaddexp, two exps, mul_, add_).
"""
from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _merge_kernel(out_ptr, lse_ptr, new_ptr, new_lse_ptr, q_len, heads,
                  n_sb, n_sl, n_sh, nl_sb, nl_sh, nl_sl,
                  HEAD_DIM: tl.constexpr, BLOCK_L: tl.constexpr):
    bh = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    offs_l = tl.program_id(0) * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_d = tl.arange(0, HEAD_DIM)
    ok = offs_l < q_len
    lse_ptrs = lse_ptr + bh.to(tl.int64) * q_len + offs_l
    lse = tl.load(lse_ptrs, mask=ok, other=0.0)
    new_lse = tl.load(new_lse_ptr + b * nl_sb + h * nl_sh + offs_l * nl_sl, mask=ok, other=0.0).to(tl.float32)
    top = tl.maximum(lse, new_lse)
    total = top + tl.log(tl.exp(lse - top) + tl.exp(new_lse - top))
    w_old = tl.exp(lse - total)
    w_new = tl.exp(new_lse - total)
    out_ptrs = out_ptr + ((b.to(tl.int64) * q_len + offs_l[:, None]) * heads + h) * HEAD_DIM + offs_d[None, :]
    new_ptrs = new_ptr + b.to(tl.int64) * n_sb + offs_l[:, None] * n_sl + h * n_sh + offs_d[None, :]
    out = tl.load(out_ptrs, mask=ok[:, None], other=0.0)
    new = tl.load(new_ptrs, mask=ok[:, None], other=0.0).to(tl.float32)
    tl.store(out_ptrs, out * w_old[:, None] + new * w_new[:, None], mask=ok[:, None])
    tl.store(lse_ptrs, total, mask=ok)


def merge_into_triton(out: Tensor, lse: Tensor, new_out: Tensor, new_lse: Tensor) -> None:
    """out float32 contiguous [B, Lq, H, D], lse float32 contiguous [B, H, Lq]; new_* any strides."""
    batch, q_len, heads, dim = out.shape
    block_l = max(1, min(64, 8192 // dim))
    grid = (triton.cdiv(q_len, block_l), batch * heads)
    _merge_kernel[grid](out, lse, new_out, new_lse, q_len, heads,
                        new_out.stride(0), new_out.stride(1), new_out.stride(2),
                        new_lse.stride(0), new_lse.stride(1), new_lse.stride(2),
                        HEAD_DIM=dim, BLOCK_L=block_l, num_warps=4)
