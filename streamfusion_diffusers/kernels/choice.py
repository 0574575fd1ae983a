"""The per-call kernel choice: which kernel runs an `attend_chunks` call (attend.py).

"reference" (float32 torch, any device), "sdpa" (PyTorch's cuDNN/flash SDPA + a one-pass merge per chunk pair),
"fused" (one launch for all chunks, merge in the kernel: paper Algorithm 2; Gluon on Hopper, Triton elsewhere:
fused.py) or "auto": reference off CUDA, sdpa where the fused kernel cannot take the call, else the faster of
sdpa and fused for the call's shape, measured once and cached in the context's KernelState (dispatch.py; inside
`agreed_choices` every rank of the layer picks the same). The rules come first, so the calls they settle cost no
measurement. Queries that see every key at once (one query chunk, one key chunk, no state: P = 1, or Ulysses
after its all-to-all) below FUSED_MIN_WORK take sdpa untimed: the fused kernel has lost every such shape
measured (BENCHMARKS.md, the kernel tables; it gains where it saves launches and merges, many chunks in one
call), and timing it there costs its compile (seconds per variant on a cold Triton cache) in a job's first step
for nothing.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager

import torch
from torch import Tensor

from ..core.mesh import Group
from . import dispatch
from .chunk_tables import aligned
from .optional import has_triton
from .partial import Partial
from .state import KernelState, owned_by

HALF = (torch.float16, torch.bfloat16)
FUSED_MIN_WORK = 25e6  # queries x keys per head of a whole-keys call below which auto takes sdpa

Pairs = Sequence[tuple[Partial, Tensor]]
KV = Sequence[tuple[Tensor, Tensor]]


def kernel_for(kernel: str, pairs: Pairs, kv: KV, finalize: bool, candidates: Callable[[], dispatch.Candidates]
               ) -> str:
    """Resolve "auto" to reference, sdpa or fused; a named kernel is checked and kept. candidates: the timed
    runs of sdpa and fused on this call, made only where its shape is measured."""
    q = pairs[0][1]
    if kernel == "fused":
        check_fused(q)
        return "fused"
    if kernel != "auto":
        return kernel
    if not (q.is_cuda and q.dtype in HALF):
        return "reference"
    if not (has_triton() and fused_supports(q)):
        return "sdpa"
    # loops, not comprehensions, and no candidates made where the shape is known: this runs at every call
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
    return dispatch.choose((q.device, q.dtype, b, h, d, tuple(q_lens), tuple(kv_lens), load_state, finalize),
                           candidates)


def agreed_choices(state: KernelState, group: Group, signature: Hashable, q: Tensor, kernel: str
                   ) -> AbstractContextManager:
    """Scope of one sp_attention layer call (signature: what every rank knows alike about it): its kernels keep
    what they keep in `state` (its context's), and its "auto" choices every rank of `group` shares (see
    dispatch.py); no agreement where no choice is measured: a named kernel, pinned choices, or no fused candidate
    for q's device, dtype and head dim (the same on every rank)."""
    if kernel == "auto" and q.is_cuda and has_triton() and fused_supports(q) and not dispatch.pinned():
        return dispatch.layer(signature, group, state)
    return owned_by(state)


def check_fused(q: Tensor) -> None:
    if not (has_triton() and fused_supports(q)):
        raise ValueError(f"kernel 'fused' needs triton and float16/bfloat16 inputs with head dim 64 or 128 "
                         f"(got {q.dtype}, head dim {q.shape[-1]}); use kernel='auto'")


# kernel -> the compute capability whose tensor cores run its 8-bit products (fp8: P V in float8)
QUANTIZED = {"int8": (8, 0), "fp8": (8, 9)}


def quantized_needs(kernel: str) -> str:
    major, minor = QUANTIZED[kernel]
    return (f"kernel {kernel!r} needs triton, a GPU of compute capability {major}.{minor} or newer and "
            f"float16/bfloat16 inputs with a head dim that is a multiple of 32")


@functools.cache
def quantized_supported(kernel: str, device: int | None = None) -> bool:
    """Whether the quantized kernel runs here: triton, and a CUDA GPU (this index, None: the current one) whose
    tensor cores multiply its format. Asked at every call: known once per device."""
    return (has_triton() and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device) >= QUANTIZED[kernel])


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read when triton is: Triton's CPU interpreter


def check_quantized(kernel: str, q: Tensor) -> None:
    """The interpreter runs the kernel on the CPU: how the tests check it."""
    runs = (INTERPRETED and has_triton()) or (q.is_cuda and quantized_supported(kernel, q.device.index))
    if not (runs and q.dtype in HALF and q.shape[-1] % 32 == 0):
        raise ValueError(f"{quantized_needs(kernel)} (got {q.dtype} on {q.device.type}, head dim {q.shape[-1]}); "
                         f"use kernel='auto'")


def fused_supports(q: Tensor) -> bool:
    return q.dtype in HALF and q.shape[-1] in (64, 128)
