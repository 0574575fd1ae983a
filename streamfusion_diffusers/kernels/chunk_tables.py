"""Algorithm 2's chunk tables: what every fused multi-chunk kernel (triton_attention, gluon_attention) is given.

Chunks are passed as tables of strides and addresses, as element offsets from one base tensor per dtype (x_base:
the query dtype, f_base: float32), so the kernels keep the compiler's 16-byte alignment facts and views (head
slices, received buffers) need no copies. Both tables are 9 int64 columns wide. Query table: q offset, q strides
(batch, row, head), rows, first tile, state offset, output offset, lse offset. Key/value table: k offset,
k strides, v offset, v strides, rows.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import torch
from torch import Tensor

from .state import current

DEVICE_TABLES = 256  # eager tables kept on the device per context (a few hundred bytes each)


@dataclass(frozen=True)
class ChunkTables:
    """One launch's tables on the device and the facts a launch needs beside them."""

    x_base: Tensor  # the query dtype's base (the first query chunk)
    f_base: Tensor  # float32's base (the first lse)
    q_table: Tensor
    kv_table: Tensor
    q_tiles: int  # programs along the query axis: sum over chunks of ceil(rows / block_m)
    kv_tiles: int  # key/value tiles over all chunks: sum of ceil(rows / block_n)
    load_state: bool
    batch: int
    heads: int
    dim: int


def chunk_tables(
    q_chunks: Sequence[Tensor],
    kv_chunks: Sequence[tuple[Tensor, Tensor]],
    states: Sequence[tuple[Tensor | None, Tensor]],
    outs: Sequence[Tensor],
    finalize: bool,
    block_m: int,
    block_n: int,
) -> ChunkTables:
    """The tables of one launch, checked on the host (a launch with a bad table faults or, with no key tile to
    wait for, hangs): every chunk half precision [B, L >= 1, H, D], aligned (see `aligned`); every state, output and
    lse laid out as the kernels address them (`_check_layout`)."""
    if not q_chunks or not kv_chunks:
        raise ValueError(f"fused attention needs at least one query and one key/value chunk, got {len(q_chunks)} "
                         f"and {len(kv_chunks)}")
    q0 = q_chunks[0]
    batch, _, heads, dim = q0.shape
    load_state = states[0][0] is not None
    x_base, f_base = q0, states[0][1]
    q_rows, q_tiles = [], 0
    for q, (state, lse), out in zip(q_chunks, states, outs, strict=True):
        _check(q, batch, heads, dim)
        _check_layout(q, state, lse, out, load_state, finalize)
        out_base = x_base if finalize else f_base
        q_rows.append([_offset(q, x_base), *q.stride()[:3], q.shape[1], q_tiles,
                       _offset(state, f_base) if load_state else 0, _offset(out, out_base), _offset(lse, f_base)])
        q_tiles += -(-q.shape[1] // block_m)
    kv_rows, kv_tiles = [], 0
    for k, v in kv_chunks:
        _check(k, batch, heads, dim)
        _check(v, batch, heads, dim)
        kv_rows.append([_offset(k, x_base), *k.stride()[:3], _offset(v, x_base), *v.stride()[:3], k.shape[1]])
        kv_tiles += -(-k.shape[1] // block_n)
    table = _device_table(q_rows + kv_rows, q0.device)  # both 9 wide: one host tensor, one copy per call
    return ChunkTables(x_base, f_base, table[:len(q_rows)], table[len(q_rows):], q_tiles, kv_tiles, load_state,
                       batch, heads, dim)


def _device_table(rows: list[list[int]], device: torch.device) -> Tensor:
    """The chunk tables on the GPU. Eager, a table already on the device serves again: its entries are offsets
    from the base tensors, so a layer whose buffers lie alike relative to each other (every step, as the caching
    allocator hands them out) makes no host copy. Otherwise from pinned memory (the only host copy a CUDA-graph
    capture allows). A replay copies from the same host memory again, so a captured table is kept as long as the
    graph: in the running call's KernelState (its context's, freed by shutdown(); a few hundred bytes per
    captured call)."""
    if device.type != "cuda":  # Triton's interpreter, on the CPU
        return torch.tensor(rows, dtype=torch.int64)
    state = current()
    if torch.cuda.is_current_stream_capturing():
        host = torch.tensor(rows, dtype=torch.int64).pin_memory()
        state.tables.append(host)
        return host.to(device, non_blocking=True)
    # the stream too: a table is read only on the stream that copied it there
    key = (torch.cuda.current_stream(device).cuda_stream, tuple(map(tuple, rows)))
    table = state.device_tables.get(key)
    if table is None:
        if len(state.device_tables) >= DEVICE_TABLES:
            del state.device_tables[next(iter(state.device_tables))]  # the oldest
        host = torch.tensor(rows, dtype=torch.int64).pin_memory()
        table = state.device_tables[key] = host.to(device, non_blocking=True)
    return table


def _offset(x: Tensor, base: Tensor) -> int:
    """x's address as an element offset from base's (same dtype); a multiple of 8 for aligned tensors."""
    delta = x.data_ptr() - base.data_ptr()
    if x.dtype != base.dtype or delta % (8 * x.element_size()):
        raise ValueError("fused attention needs 16-byte (float32 state: 32-byte) aligned tensors of one dtype")
    return delta // x.element_size()


def aligned(x: Tensor) -> bool:
    """The kernels' alignment contract: a [B, L, H, D] tensor at a 16-byte address, contiguous last dim, other
    strides multiples of 8."""
    s = x.stride()  # [B, L, H, D]; indexed, not a generator: this runs at every call
    return len(s) == 4 and x.data_ptr() % 16 == 0 and s[3] == 1 and s[0] % 8 == 0 and s[1] % 8 == 0 and \
        s[2] % 8 == 0


def _check(x: Tensor, batch: int, heads: int, dim: int) -> None:
    if x.dtype not in (torch.float16, torch.bfloat16) or not aligned(x) or x.shape[0] != batch or \
            x.shape[2:] != (heads, dim) or x.shape[1] == 0:
        raise ValueError(f"fused attention needs float16/bfloat16 [B={batch}, L >= 1, H={heads}, D={dim}] chunks, "
                         f"16-byte aligned with strides (but the last, 1) multiples of 8; got {tuple(x.shape)} "
                         f"{x.dtype} strides {x.stride()}")


def _check_layout(q: Tensor, state: Tensor | None, lse: Tensor, out: Tensor, load_state: bool,
                  finalize: bool) -> None:
    """The layouts the kernels address by q's shape alone: state and output contiguous [B, Lq, H, D] (float32, or
    the query dtype when finalized), lse contiguous float32 [B, H, Lq], all on q's device."""
    b, length, h, _ = q.shape
    want = [("lse", lse, (b, h, length), torch.float32),
            ("out", out, tuple(q.shape), q.dtype if finalize else torch.float32)]
    if (state is not None) != load_state:
        raise ValueError("fused attention loads a state for every query chunk of a launch or for none")
    if load_state:
        want.append(("state", state, tuple(q.shape), torch.float32))
    for name, x, shape, dtype in want:
        if tuple(x.shape) != shape or x.dtype != dtype or not x.is_contiguous() or x.device != q.device:
            raise ValueError(f"fused attention writes {name} as a contiguous {dtype} tensor {list(shape)} on "
                             f"{q.device}; got {list(x.shape)} {x.dtype} strides {x.stride()} on {x.device}")


@cache  # Triton's allocator is process-wide and this one holds nothing: set once, it serves every context
def set_tma_allocator() -> None:
    """Tensor descriptors made inside a kernel need global scratch memory, taken from PyTorch's allocator."""
    import triton

    triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
