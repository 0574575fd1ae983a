"""Fused multi-chunk attention in Triton (paper Appendix C, Algorithm 2).

One launch attends several query chunks to several key/value chunks of any lengths and strides, loads the
running state of each query row, merges in registers and stores the state back, or finalizes the output.
Chunks are passed as tables of strides and addresses (chunk_tables.py); views need no copies.
The state is kept normalised, (O, lse) with O = O'/l and lse = m + ln l, which is the paper's (O', l, m)
with l = 1 and m = lse: loading it costs no division, and storing it costs one per row.

Grid: (sum of query tiles over all chunks, B * H). A program finds its query chunk by scanning the
prefix sums of tile counts (Algorithm 2, line 7), then streams every tile of every key/value chunk.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from .chunk_tables import chunk_tables, set_tma_allocator

LOG2E = 1.4426950408889634

@dataclass(frozen=True)
class TileConfig:
    """Launch shape: query rows per program, key rows per step, warps, software-pipeline depth, and whether
    key/value tiles come through Hopper's tensor-memory accelerator (TMA) or plain vector loads."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 2
    use_tma: bool = False


# The fastest of benchmarks/kernels_bench.py's tiling sweep; at head dim 128 the kernel tables
# (benchmarks/results/2026-11-24-*/kernel_table*.json) time four other tilings beside it at every share, none
# faster.
DEFAULT_CONFIGS: dict[int, TileConfig] = {
    64: TileConfig(block_m=128, block_n=64, num_warps=8, num_stages=3, use_tma=False),
    128: TileConfig(block_m=128, block_n=128, num_warps=8, num_stages=3, use_tma=True),
}


@triton.jit
def _address(base, entry, b, h):
    """Row 0 of batch b, head h of the chunk whose table entry is (offset from base, strides b, l, h).

    The launcher checks that offsets and strides are multiples of 8 elements (16 bytes); the hint lets the
    compiler use 16-byte loads, which it cannot prove for offsets read from a table.
    """
    offset = tl.multiple_of(tl.load(entry), 8)
    return base + offset + b * tl.multiple_of(tl.load(entry + 1), 8) + h * tl.multiple_of(tl.load(entry + 3), 8)


@triton.jit
def _softmax_step(acc, m_i, l_i, q, k, v, offs_n, kv_len, qk_scale, DTYPE: tl.constexpr, MASK: tl.constexpr):
    """One key/value tile: online softmax update of (acc, m, l) in base 2 (Algorithm 2, lines 20-25)."""
    qk = tl.dot(q, tl.trans(k))
    if MASK:
        qk = tl.where((offs_n < kv_len)[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(DTYPE), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _multi_chunk_attention(
    x_base, f_base, q_table, kv_table, n_q, n_kv, heads, qk_scale,
    DTYPE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    LOAD_STATE: tl.constexpr, FINALIZE: tl.constexpr, USE_TMA: tl.constexpr,
):
    tile = tl.program_id(0)
    b = tl.program_id(1) // heads
    h = tl.program_id(1) % heads

    # Algorithm 2 line 7: the query chunk whose tile range holds this program.
    chunk = 0
    for c in range(1, n_q):
        chunk += (tile >= tl.load(q_table + c * 9 + 5)).to(tl.int32)
    row = q_table + chunk * 9
    q_len = tl.load(row + 4)
    q_len32 = q_len.to(tl.int32)
    offs_m = (tile - tl.load(row + 5).to(tl.int32)) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    row_ok = offs_m < q_len32

    q_base = _address(x_base, row, b, h)
    q_row = tl.multiple_of(tl.load(row + 2), 8)
    q = tl.load(q_base + offs_m[:, None] * q_row + offs_d[None, :], mask=row_ok[:, None], other=0.0)

    # State tensors are contiguous: out [B, Lq, H, D], lse [B, H, Lq]. Lines 10-15: load the running state.
    out_offs = ((b * q_len + offs_m[:, None]) * heads + h) * HEAD_DIM + offs_d[None, :]
    lse_ptrs = f_base + tl.load(row + 8) + (b * heads + h) * q_len + offs_m
    if LOAD_STATE:
        acc = tl.load(f_base + tl.multiple_of(tl.load(row + 6), 8) + out_offs, mask=row_ok[:, None], other=0.0)
        m_i = tl.load(lse_ptrs, mask=row_ok, other=0.0) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)

    # Lines 16-25: every tile of every key/value chunk; full tiles unmasked, the last partial tile masked.
    for j in range(n_kv):
        kv = kv_table + j * 9
        kv_len = tl.load(kv + 8).to(tl.int32)
        k_base = _address(x_base, kv, b, h)
        v_base = _address(x_base, kv + 4, b, h)
        k_row = tl.multiple_of(tl.load(kv + 2), 8)
        v_row = tl.multiple_of(tl.load(kv + 6), 8)
        full = (kv_len // BLOCK_N) * BLOCK_N
        if USE_TMA:  # Hopper's bulk tensor copies; rows past the chunk's end read as zeros
            k_desc = tl.make_tensor_descriptor(k_base, [kv_len, HEAD_DIM], [k_row, 1], [BLOCK_N, HEAD_DIM])
            v_desc = tl.make_tensor_descriptor(v_base, [kv_len, HEAD_DIM], [v_row, 1], [BLOCK_N, HEAD_DIM])
            for start in range(0, full, BLOCK_N):
                acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, k_desc.load([start, 0]), v_desc.load([start, 0]),
                                              offs_n, kv_len, qk_scale, DTYPE, False)
            if full < kv_len:
                acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, k_desc.load([full, 0]), v_desc.load([full, 0]),
                                              offs_n + full, kv_len, qk_scale, DTYPE, True)
        else:
            k_ptrs = k_base + offs_n[:, None] * k_row + offs_d[None, :]
            v_ptrs = v_base + offs_n[:, None] * v_row + offs_d[None, :]
            for start in range(0, full, BLOCK_N):
                acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, tl.load(k_ptrs), tl.load(v_ptrs),
                                              offs_n, kv_len, qk_scale, DTYPE, False)
                k_ptrs += BLOCK_N * k_row
                v_ptrs += BLOCK_N * v_row
            if full < kv_len:
                tail = (offs_n + full < kv_len)[:, None]
                acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, tl.load(k_ptrs, mask=tail, other=0.0),
                                              tl.load(v_ptrs, mask=tail, other=0.0), offs_n + full, kv_len,
                                              qk_scale, DTYPE, True)

    # Lines 27-32, normalised: one division per row, lse back to natural log; finalize writes the query dtype.
    acc = acc / l_i[:, None]
    tl.store(lse_ptrs, (m_i + tl.math.log2(l_i)) * 0.6931471805599453, mask=row_ok)
    if FINALIZE:
        tl.store(x_base + tl.multiple_of(tl.load(row + 7), 8) + out_offs, acc.to(DTYPE), mask=row_ok[:, None])
    else:
        tl.store(f_base + tl.multiple_of(tl.load(row + 7), 8) + out_offs, acc, mask=row_ok[:, None])


_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def multi_chunk_attention(
    q_chunks: Sequence[Tensor],
    kv_chunks: Sequence[tuple[Tensor, Tensor]],
    states: Sequence[tuple[Tensor | None, Tensor]],
    outs: Sequence[Tensor],
    scale: float,
    finalize: bool,
    config: TileConfig | None = None,
) -> None:
    """One launch of Algorithm 2.

    q_chunks[i] [B, Lq_i, H, D] and each (k, v) [B, Lk_j, H, D] may be strided views (last dim contiguous).
    states[i] = (out, lse): float32 contiguous [B, Lq_i, H, D] and [B, H, Lq_i]; out None for all i means
    "no earlier state" (the state is not read). outs[i] receives the result: the float32 state (may be the
    state tensor itself) or, with finalize, the output in the query dtype. lse is updated in place.
    """
    cfg = config or DEFAULT_CONFIGS[q_chunks[0].shape[-1]]
    t = chunk_tables(q_chunks, kv_chunks, states, outs, finalize, cfg.block_m, cfg.block_n)
    if cfg.use_tma:
        set_tma_allocator()
    _multi_chunk_attention[(t.q_tiles, t.batch * t.heads)](
        t.x_base, t.f_base, t.q_table, t.kv_table, len(t.q_table), len(t.kv_table), t.heads, scale * LOG2E,
        DTYPE=_TL_DTYPES[t.x_base.dtype], HEAD_DIM=t.dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        LOAD_STATE=t.load_state, FINALIZE=finalize, USE_TMA=cfg.use_tma,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
