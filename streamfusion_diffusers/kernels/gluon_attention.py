"""Fused multi-chunk attention for Hopper in Gluon (paper Appendix C, Algorithm 2, with FA3's schedule).

The same contract as triton_attention.multi_chunk_attention (chunk tables, running state, finalize), written in
Gluon, Triton's lower-level language, so that the schedule cuDNN and FlashAttention-3 use on Hopper can be
expressed, which plain Triton does not emit:
- warp specialization: one warp issues the bulk tensor copies (TMA) of K and V tiles into a ring of shared-memory
  stages; two consumer warpgroups compute, each on half of the program's query rows, with most of the registers
  (setmaxnreg);
- intra-warpgroup overlap: a consumer issues S_i = Q K_i^T and O += P_{i-1} V_{i-1} back to back and does the
  softmax of S_i while the second product runs; P stays in registers as the A operand of the second product.
FA3's ping-pong (the two consumers taking turns at the tensor cores) gave nothing here
(benchmarks/results/2026-11-24-h200-gluon/variants.txt), so the warp schedulers interleave the two freely.

Grid: (sum of query tiles over all chunks, B * H); a program owns BLOCK_M query rows of one head.
"""
from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .chunk_tables import chunk_tables, set_tma_allocator
from .triton_attention import LOG2E

# Triton 3.7 renamed the bulk tensor load (3.9 removed the old name); the kernel runs on either.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

# 128 key rows per tile and two stages beat 64-row tiles and three stages, which gain nothing and leave no shared
# memory at head dim 128 (benchmarks/results/2026-11-24-h200-gluon/variants.txt).
BLOCK_M = 128  # query rows per program: 64 per consumer warpgroup
BLOCK_N = 128
STAGES = 2
# Registers per thread: 168 on average over the 3 warpgroups (one program per SM); the loader warp's group gives
# its share to the consumers.
MAXNREG = 168
CONSUMER_REGS = gl.constexpr(240)
LOADER_REGS = gl.constexpr(24)


@gluon.jit
def _locate(q_table, n_q, heads, BLOCK_M: gl.constexpr):
    """This program's (batch, head, query-table row, chunk length, first row in the chunk): Algorithm 2 line 7."""
    tile = gl.program_id(0)
    bh = gl.program_id(1)
    chunk = 0
    for c in range(1, n_q):
        chunk += (tile >= gl.load(q_table + c * 9 + 5)).to(gl.int32)
    row = q_table + chunk * 9
    q_len = gl.load(row + 4).to(gl.int32)
    m0 = (tile - gl.load(row + 5).to(gl.int32)) * BLOCK_M
    return bh // heads, bh % heads, row, q_len, m0


@gluon.jit
def _address(base, entry, b, h):
    """Row 0 of batch b, head h of the chunk whose table entry is (offset from base, strides b, l, h)."""
    offset = gl.multiple_of(gl.load(entry), 8)
    return base + offset + b * gl.multiple_of(gl.load(entry + 1), 8) + h * gl.multiple_of(gl.load(entry + 3), 8)


@gluon.jit
def _descriptor(base, entry, b, h, rows, BLOCK: gl.constexpr, HEAD_DIM: gl.constexpr, LAYOUT: gl.constexpr):
    """A TMA descriptor over one chunk's [rows, HEAD_DIM] slice of (b, h); rows past its end read as zeros."""
    stride = gl.multiple_of(gl.load(entry + 2), 8)
    return tma.make_tensor_descriptor(_address(base, entry, b, h), [rows, HEAD_DIM], [stride, 1],
                                      [BLOCK, HEAD_DIM], LAYOUT)


@gluon.jit
def _load_partition(x_base, q_table, kv_table, n_q, n_kv, heads, q_smem, k_smem, v_smem,
                    q_bar, k_ready, k_empty, v_ready, v_empty,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                    Q_LAYOUT: gl.constexpr, KV_LAYOUT: gl.constexpr, STAGES: gl.constexpr):
    """One warp: the program's two query halves once, then every K and V tile of every chunk into the ring."""
    b, h, row, q_len, m0 = _locate(q_table, n_q, heads, BLOCK_M)
    q_desc = _descriptor(x_base, row, b, h, q_len, BLOCK_M // 2, HEAD_DIM, Q_LAYOUT)
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    _tma_load(q_desc, [m0, 0], q_bar, q_smem.index(0))
    _tma_load(q_desc, [m0 + BLOCK_M // 2, 0], q_bar, q_smem.index(1))
    i = 0
    for j in range(n_kv):
        entry = kv_table + j * 9
        kv_len = gl.load(entry + 8).to(gl.int32)
        k_desc = _descriptor(x_base, entry, b, h, kv_len, BLOCK_N, HEAD_DIM, KV_LAYOUT)
        v_desc = _descriptor(x_base, entry + 4, b, h, kv_len, BLOCK_N, HEAD_DIM, KV_LAYOUT)
        for start in range(0, kv_len, BLOCK_N):
            stage = i % STAGES
            phase = (i // STAGES) & 1
            mbarrier.wait(k_empty.index(stage), phase ^ 1)
            mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
            _tma_load(k_desc, [start, 0], k_ready.index(stage), k_smem.index(stage))
            mbarrier.wait(v_empty.index(stage), phase ^ 1)
            mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
            _tma_load(v_desc, [start, 0], v_ready.index(stage), v_smem.index(stage))
            i += 1


@gluon.jit
def _softmax(s, m_i, valid, qk_scale, BLOCK_N: gl.constexpr, S_LAYOUT: gl.constexpr, ROWS: gl.constexpr):
    """Online softmax of one S tile in base 2 (Algorithm 2, lines 20-25): (new max, P, rescale, row sums), the
    row vectors in the output's row layout ROWS. Columns from `valid` on are past the chunk's end (TMA read them as
    zeros) and are masked."""
    if valid < BLOCK_N:
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
        s = gl.where((cols < valid)[None, :], s, float("-inf"))
    m_old = gl.convert_layout(m_i, gl.SliceLayout(1, S_LAYOUT))
    m_new = gl.maximum(m_old, gl.max(s, 1) * qk_scale)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_old - m_new)
    return (gl.convert_layout(m_new, ROWS), p, gl.convert_layout(alpha, ROWS),
            gl.convert_layout(gl.sum(p, 1), ROWS))


@gluon.jit
def _softmax_partition(x_base, f_base, q_table, kv_table, n_q, n_tiles, heads, qk_scale, q_smem, k_smem, v_smem,
                       q_bar, k_ready, k_empty, v_ready, v_empty,
                       WG: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                       STAGES: gl.constexpr, LOAD_STATE: gl.constexpr, FINALIZE: gl.constexpr):
    """One consumer warpgroup: query rows [WG * BLOCK_M / 2, (WG + 1) * BLOCK_M / 2) of the program's tile."""
    HALF: gl.constexpr = BLOCK_M // 2
    S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
    ROWS: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
    dtype = x_base.dtype.element_ty

    b, h, row, q_len, m0 = _locate(q_table, n_q, heads, BLOCK_M)
    offs_m = m0 + WG * HALF + gl.arange(0, HALF, layout=ROWS)
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, O_LAYOUT))
    row_ok = offs_m < q_len
    # State tensors are contiguous: out [B, Lq, H, D], lse [B, H, Lq]. Lines 10-15: load the running state.
    # Offsets in int64 (the table's type): B * Lq * H * D passes 2^31 at about 300k tokens of 24 x 128 with CFG.
    q_len64 = gl.load(row + 4)
    out_offs = ((b * q_len64 + offs_m[:, None]) * heads + h) * HEAD_DIM + offs_d[None, :]
    lse_ptrs = f_base + gl.load(row + 8) + (b * heads + h) * q_len64 + offs_m
    if LOAD_STATE:
        acc = gl.load(f_base + gl.multiple_of(gl.load(row + 6), 8) + out_offs, mask=row_ok[:, None], other=0.0)
        m_i = gl.load(lse_ptrs, mask=row_ok, other=0.0) * 1.4426950408889634
        l_i = gl.full([HALF], 1.0, gl.float32, ROWS)
    else:
        acc = gl.zeros([HALF, HEAD_DIM], gl.float32, O_LAYOUT)
        m_i = gl.full([HALF], float("-inf"), gl.float32, ROWS)
        l_i = gl.zeros([HALF], gl.float32, ROWS)
    s_zero = gl.zeros([HALF, BLOCK_N], gl.float32, S_LAYOUT)

    # Which chunk tile i falls in: the tiles of chunk j are ceil(len_j / BLOCK_N), in table order.
    kv_len = gl.load(kv_table + 8).to(gl.int32)
    start = 0
    chunk = 0

    mbarrier.wait(q_bar, 0)
    q = q_smem.index(WG)

    # Tile 0: S_0 alone.
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    mbarrier.arrive(k_empty.index(0), count=1)
    m_i, p, alpha, row_sum = _softmax(s, m_i, kv_len - start, qk_scale, BLOCK_N, S_LAYOUT, ROWS)
    acc = acc * alpha[:, None]
    l_i = l_i * alpha + row_sum
    p_op = gl.convert_layout(p.to(dtype), P_LAYOUT)

    for i in range(1, n_tiles):
        start += BLOCK_N
        if start >= kv_len:
            chunk += 1
            start = 0
            kv_len = gl.load(kv_table + chunk * 9 + 8).to(gl.int32)
        stage = i % STAGES
        prev = (i - 1) % STAGES
        # Issue S_i = Q K_i^T and O += P_{i-1} V_{i-1} back to back.
        mbarrier.wait(k_ready.index(stage), (i // STAGES) & 1)
        s = warpgroup_mma(q, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(prev), ((i - 1) // STAGES) & 1)
        acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
        # S_i is done when at most the second product is in flight; its softmax overlaps that product.
        s = warpgroup_mma_wait(1, deps=(s,))
        mbarrier.arrive(k_empty.index(stage), count=1)
        m_i, p, alpha, row_sum = _softmax(s, m_i, kv_len - start, qk_scale, BLOCK_N, S_LAYOUT, ROWS)
        acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
        mbarrier.arrive(v_empty.index(prev), count=1)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + row_sum
        p_op = gl.convert_layout(p.to(dtype), P_LAYOUT)

    # The last tile's O += P V.
    last = (n_tiles - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // STAGES) & 1)
    acc = warpgroup_mma(p_op, v_smem.index(last), acc, is_async=True)
    acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
    mbarrier.arrive(v_empty.index(last), count=1)

    # Lines 27-32, normalised: one division per row, lse back to natural log; finalize writes the query dtype.
    acc = acc / l_i[:, None]
    gl.store(lse_ptrs, (m_i + gl.log2(l_i)) * 0.6931471805599453, mask=row_ok)
    if FINALIZE:
        gl.store(x_base + gl.multiple_of(gl.load(row + 7), 8) + out_offs, acc.to(dtype), mask=row_ok[:, None])
    else:
        gl.store(f_base + gl.multiple_of(gl.load(row + 7), 8) + out_offs, acc, mask=row_ok[:, None])


@gluon.jit
def _multi_chunk_attention(x_base, f_base, q_table, kv_table, n_q, n_kv, n_tiles, heads, qk_scale,
                           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                           STAGES: gl.constexpr, Q_LAYOUT: gl.constexpr, KV_LAYOUT: gl.constexpr,
                           LOAD_STATE: gl.constexpr, FINALIZE: gl.constexpr):
    """One program: its shared memory and barriers, then the loader warp and the two consumers side by side."""
    dtype: gl.constexpr = x_base.dtype.element_ty
    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M // 2, HEAD_DIM], Q_LAYOUT)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], KV_LAYOUT)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], KV_LAYOUT)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(s), count=1)
        mbarrier.init(v_ready.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=2)  # both consumers release a stage
        mbarrier.init(v_empty.index(s), count=2)

    gl.warp_specialize([
        (_softmax_partition, (x_base, f_base, q_table, kv_table, n_q, n_tiles, heads, qk_scale, q_smem, k_smem,
                              v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, 0, BLOCK_M, BLOCK_N,
                              HEAD_DIM, STAGES, LOAD_STATE, FINALIZE)),
        (_softmax_partition, (x_base, f_base, q_table, kv_table, n_q, n_tiles, heads, qk_scale, q_smem, k_smem,
                              v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, 1, BLOCK_M, BLOCK_N,
                              HEAD_DIM, STAGES, LOAD_STATE, FINALIZE)),
        (_load_partition, (x_base, q_table, kv_table, n_q, n_kv, heads, q_smem, k_smem, v_smem,
                           q_bar, k_ready, k_empty, v_ready, v_empty, BLOCK_M, BLOCK_N, HEAD_DIM,
                           Q_LAYOUT, KV_LAYOUT, STAGES)),
    ], [4, 1], [CONSUMER_REGS, LOADER_REGS])


_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}


def multi_chunk_attention(
    q_chunks: Sequence[Tensor],
    kv_chunks: Sequence[tuple[Tensor, Tensor]],
    states: Sequence[tuple[Tensor | None, Tensor]],
    outs: Sequence[Tensor],
    scale: float,
    finalize: bool,
) -> None:
    """One launch of Algorithm 2 on Hopper; the arguments are triton_attention.multi_chunk_attention's."""
    t = chunk_tables(q_chunks, kv_chunks, states, outs, finalize, BLOCK_M, BLOCK_N)
    set_tma_allocator()
    q_layout, kv_layout = _shared_layouts(t.x_base.dtype, t.dim)
    _multi_chunk_attention[(t.q_tiles, t.batch * t.heads)](
        t.x_base, t.f_base, t.q_table, t.kv_table, len(t.q_table), len(t.kv_table), t.kv_tiles, t.heads,
        scale * LOG2E, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=t.dim, STAGES=STAGES, Q_LAYOUT=q_layout,
        KV_LAYOUT=kv_layout, LOAD_STATE=t.load_state, FINALIZE=finalize, num_warps=4, maxnreg=MAXNREG,
    )


@cache  # one pair per dtype and head dim, not one per attention call
def _shared_layouts(dtype: torch.dtype, dim: int) -> tuple[gl.NVMMASharedLayout, gl.NVMMASharedLayout]:
    """The swizzled shared-memory layouts TMA writes and wgmma reads: a query half tile and a key/value tile."""
    elem = _GL_DTYPES[dtype]
    return (gl.NVMMASharedLayout.get_default_for([BLOCK_M // 2, dim], elem),
            gl.NVMMASharedLayout.get_default_for([BLOCK_N, dim], elem))
