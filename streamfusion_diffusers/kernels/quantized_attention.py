"""Attention with its log-sum-exp on 8-bit tensor cores: the "int8" and "fp8" kernels.

Both run Q K^T in int8: each query and key row scaled into [-127, 127] by its own absolute maximum, so the scores
are those of the quantized rows times two exact float32 factors (int8 is the more accurate 8-bit format at the
same tensor-core rate: its 255 levels are evenly spaced over each row's range, where e4m3 spends bits on an
exponent the row's scale already sets). Keys are smoothed first, as SageAttention does: the mean key of the chunk
is subtracted, which leaves every softmax row unchanged (it shifts a row's scores by one constant) while the rows
left are small, so 8 bits keep more of them. The kernels differ in P V:

- "int8": P V in the inputs' half precision (compute capability 8.0+).
- "fp8": P V on float8 tensor cores, as SageAttention 2 does (8.9+): P, in [0, 1], is quantized to e4m3 by the
  fixed scale 448 (its largest value), V per channel by its absolute maximum over the chunk's keys; each key
  block's products are summed in float32 apart from the running output (Hopper's float8 accumulator keeps fewer
  bits), and the V scales, one per output channel, are applied to the output once at the end.

The softmax's running maximum and sum are those of the unquantized float32 scores, so the output is normalized
as in the "int8" kernel and the log-sum-exp does not see P's quantization; the smoothing's shift is added back
to it, so the partial results of a ring or Torus pass merge exactly as the other kernels' do.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

INT8_MAX, E4M3_MAX = 127.0, 448.0
LOG2E = 1.4426950408889634
BLOCK_M, BLOCK_N = 128, 64
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [B, L, H, D] as int8 rows [B, H, L, D] (contiguous, as the kernel reads them) and each row's float32
    scale [B, H, L] (x = rows * scale)."""
    x = x.float().transpose(1, 2)
    scale = x.abs().amax(-1).clamp_min(1e-12) / INT8_MAX
    return (x / scale.unsqueeze(-1)).round().to(torch.int8).contiguous(), scale.contiguous()


def quantize_channels(v: Tensor) -> tuple[Tensor, Tensor]:
    """v [B, L, H, D] as e4m3 of that shape, stored keys last (float8 tensor cores read P V's second operand
    key-major; each channel's row rounded up to whole 16 bytes, so its loads stay aligned), and each channel's
    float32 scale over the keys [B, H, D]: one per output channel, which the kernel applies once to its output."""
    b, n, h, d = v.shape
    v = v.float()
    scale = v.abs().amax(1).clamp_min(1e-12) / E4M3_MAX
    rows = torch.empty((b, h, d, -(-n // 16) * 16), dtype=torch.float8_e4m3fn, device=v.device)[..., :n]
    rows.copy_((v / scale.unsqueeze(1)).permute(0, 2, 3, 1))
    return rows.permute(0, 3, 1, 2), scale.contiguous()


@triton.jit
def _quantized_attention(q8, q_scale, k8, k_scale, v, v_scale, out, lse, q_len, k_len, heads,
                         v_b, v_l, v_h, v_d, qk_scale,
                         DTYPE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, PV_FP8: tl.constexpr, P_SCALE: tl.constexpr):
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
        s = tl.dot(q, tl.trans(k)).to(tl.float32) * sq[:, None] * sk[None, :]  # int32 sums
        s = tl.where(col_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)  # of the unquantized P: the LSE and the normalization
        vt = tl.load(v + b * v_b + cols[:, None] * v_l + h * v_h + offs_d[None, :] * v_d, mask=col_ok[:, None],
                     other=0.0)
        if PV_FP8:
            acc = acc * alpha[:, None] + tl.dot((p * P_SCALE).to(tl.float8e4nv), vt)
        else:
            acc = tl.dot(p.to(DTYPE), vt, acc * alpha[:, None])
        m_i = m_new
    if PV_FP8:
        acc = acc * (tl.load(v_scale + bh * HEAD_DIM + offs_d) / P_SCALE)[None, :]
    acc = acc / l_i[:, None]
    tl.store(out + ((b * q_len + offs_m[:, None]) * heads + h) * HEAD_DIM + offs_d[None, :], acc.to(DTYPE),
             mask=row_ok[:, None])
    tl.store(lse + bh * q_len + offs_m, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, mask=row_ok)


def attention_with_lse_quantized(q: Tensor, k: Tensor, v: Tensor, scale: float, kernel: str
                                 ) -> tuple[Tensor, Tensor]:
    """Attention of q [B, Lq, H, D] over k, v [B, Lk, H, D] by the kernel "int8" or "fp8" (the module's
    docstring): the output [B, Lq, H, D] in the inputs' dtype and the natural-log LSE [B, H, Lq] in float32 (of
    the unsmoothed scores)."""
    b, q_len, heads, dim = q.shape
    k_len = k.shape[1]
    q, k = q.float(), k.float()  # once: the quantization and the shift below both read them
    mean = k.mean(1, keepdim=True)  # [B, 1, H, D]: the smoothing, undone in the LSE below
    q8, q_scale = quantize_rows(q)
    k8, k_scale = quantize_rows(k - mean)
    out = torch.empty(q.shape, dtype=v.dtype, device=q.device)
    pv_fp8 = kernel == "fp8"
    v, v_scale = quantize_channels(v) if pv_fp8 else (v if v.stride(-1) == 1 else v.contiguous(), None)
    lse = torch.empty((b, heads, q_len), dtype=torch.float32, device=q.device)
    grid = (triton.cdiv(q_len, BLOCK_M), b * heads)
    _quantized_attention[grid](q8, q_scale, k8, k_scale, v, v_scale, out, lse, q_len, k_len, heads,
                               *v.stride(), scale * LOG2E,
                               DTYPE=_TL_DTYPES[out.dtype], HEAD_DIM=dim, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                               PV_FP8=pv_fp8, P_SCALE=E4M3_MAX, num_warps=8, num_stages=3)
    shift = torch.einsum("blhd,bhd->bhl", q, mean[:, 0]) * scale  # each row's scores less the smoothed
    return out, lse + shift


__all__ = ["attention_with_lse_quantized", "quantize_channels", "quantize_rows"]
