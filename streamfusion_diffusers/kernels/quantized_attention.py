"""Attention with its log-sum-exp on quantized queries and keys: the "int8" and "fp8" kernels.

Q K^T runs on 8-bit tensor cores (int8, or float8 e4m3); the probabilities and V stay in the inputs' half
precision (P's small entries are the ones 8 bits round away). Each query and key row is scaled into the 8-bit
range by its own absolute maximum, so the scores are those of the quantized rows times two exact float32 factors.
int8 is the more accurate at the same tensor-core rate: its 255 levels are evenly spaced over each row's range,
where e4m3 spends bits on an exponent the row's scale already sets. Keys are smoothed first, as SageAttention
does: the mean key of the chunk is subtracted, which leaves every softmax row unchanged (it shifts a row's scores
by one constant) while the rows left are small, so 8 bits keep more of them. The shift is added back to the
log-sum-exp, so the partial results of a ring or Torus pass merge exactly as the other kernels' do.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# an 8-bit format of Q and K: its torch dtype, largest value, whether values round to integers, and the
# compute capability whose tensor cores multiply it
QK_FORMATS = {"int8": (torch.int8, 127.0, True, (8, 0)), "fp8": (torch.float8_e4m3fn, 448.0, False, (8, 9))}
LOG2E = 1.4426950408889634
BLOCK_M, BLOCK_N = 128, 64
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def quantize_rows(x: Tensor, qk: str) -> tuple[Tensor, Tensor]:
    """x [B, L, H, D] as 8-bit rows [B, H, L, D] of format `qk` (contiguous, as the kernel reads them) and each
    row's float32 scale [B, H, L] (x = rows * scale)."""
    dtype, largest, integer, _ = QK_FORMATS[qk]
    x = x.float().transpose(1, 2)
    scale = x.abs().amax(-1).clamp_min(1e-12) / largest
    rows = x / scale.unsqueeze(-1)
    return (rows.round() if integer else rows).to(dtype).contiguous(), scale.contiguous()


@triton.jit
def _quantized_attention(q8, q_scale, k8, k_scale, v, out, lse, q_len, k_len, heads,
                   v_b, v_l, v_h, qk_scale,
                   DTYPE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    tile, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // heads, bh % heads
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = offs_m < q_len
    q = tl.load(q8 + (bh * q_len + offs_m[:, None]) * HEAD_DIM + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    sq = tl.load(q_scale + bh * q_len + offs_m, mask=row_ok, other=0.0) * qk_scale  # base-2 logits per unit
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start in range(0, k_len, BLOCK_N):
        cols = start + offs_n
        col_ok = cols < k_len
        k = tl.load(k8 + (bh * k_len + cols[:, None]) * HEAD_DIM + offs_d[None, :], mask=col_ok[:, None], other=0.0)
        sk = tl.load(k_scale + bh * k_len + cols, mask=col_ok, other=0.0)
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * sq[:, None] * sk[None, :]  # int8: int32 sums
        s = tl.where(col_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(v + b * v_b + cols[:, None] * v_l + h * v_h + offs_d[None, :], mask=col_ok[:, None], other=0.0)
        acc = tl.dot(p.to(DTYPE), vt, acc * alpha[:, None])
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(out + ((b * q_len + offs_m[:, None]) * heads + h) * HEAD_DIM + offs_d[None, :], acc.to(DTYPE),
             mask=row_ok[:, None])
    tl.store(lse + bh * q_len + offs_m, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, mask=row_ok)


def attention_with_lse_quantized(q: Tensor, k: Tensor, v: Tensor, scale: float, qk: str
                                 ) -> tuple[Tensor, Tensor]:
    """Attention of q [B, Lq, H, D] over k, v [B, Lk, H, D] with Q K^T in the 8-bit format `qk` ("int8" or
    "fp8"): the output [B, Lq, H, D] in the inputs' dtype and the natural-log LSE [B, H, Lq] in float32 (of the
    unsmoothed scores)."""
    b, q_len, heads, dim = q.shape
    k_len = k.shape[1]
    q, k = q.float(), k.float()  # once: the quantization and the shift below both read them
    mean = k.mean(1, keepdim=True)  # [B, 1, H, D]: the smoothing, undone in the LSE below
    q8, q_scale = quantize_rows(q, qk)
    k8, k_scale = quantize_rows(k - mean, qk)
    v = v if v.stride(-1) == 1 else v.contiguous()
    out = torch.empty(q.shape, dtype=v.dtype, device=q.device)
    lse = torch.empty((b, heads, q_len), dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(q_len, BLOCK_M), b * heads)
    _quantized_attention[grid](q8, q_scale, k8, k_scale, v, out, lse, q_len, k_len, heads,
                                v.stride(0), v.stride(1), v.stride(2), scale * LOG2E,
                                DTYPE=_TL_DTYPES[v.dtype], HEAD_DIM=dim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                                num_warps=8, num_stages=3)
    shift = torch.einsum("blhd,bhd->bhl", q, mean[:, 0]) * scale  # each row's scores less the smoothed
    return out, lse + shift


__all__ = ["QK_FORMATS", "attention_with_lse_quantized", "quantize_rows"]
