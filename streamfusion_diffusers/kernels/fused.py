"""The fused multi-chunk kernel (paper Algorithm 2) for a device: Gluon's on Hopper, Triton's elsewhere.

On Hopper (compute capability 9.0) the Gluon kernel (gluon_attention.py) runs the warp-specialized schedule cuDNN
uses and matches it (1.00x cuDNN with LSE at head dim 128 on one H200, where the portable Triton kernel reaches
0.90x; BENCHMARKS.md). Other GPUs, Triton's CPU interpreter, and triton older than 3.6 (whose Gluon lacks what the
kernel uses) take triton_attention.py. Both read the same chunk tables (chunk_tables.py).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import cache

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

GLUON_TRITON = (3, 6)  # the oldest triton whose Gluon has every Hopper operation the kernel uses

Kernel = Callable[..., None]


def multi_chunk_attention(
    q_chunks: Sequence[Tensor],
    kv_chunks: Sequence[tuple[Tensor, Tensor]],
    states: Sequence[tuple[Tensor | None, Tensor]],
    outs: Sequence[Tensor],
    scale: float,
    finalize: bool,
) -> None:
    """One launch of Algorithm 2 by the device's kernel; arguments as triton_attention.multi_chunk_attention."""
    kernel_for(q_chunks[0].device)(q_chunks, kv_chunks, states, outs, scale, finalize)


@cache  # a probe of the device and the installed triton: the same for every context
def kernel_for(device: torch.device) -> Kernel:
    """The fused kernel that runs fastest on `device`; the choice is logged once."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0):
        import triton

        installed = tuple(int(part) for part in triton.__version__.split(".")[:2])
        if installed >= GLUON_TRITON:
            from .gluon_attention import multi_chunk_attention as gluon_kernel

            logger.info("fused attention on %s: the Gluon Hopper kernel", torch.cuda.get_device_name(device))
            return gluon_kernel
        logger.info("fused attention on %s: the portable Triton kernel, as triton %s has no Gluon Hopper kernel "
                    "(pip install 'triton>=%d.%d' for it)", torch.cuda.get_device_name(device), triton.__version__,
                    *GLUON_TRITON)
    from .triton_attention import multi_chunk_attention as triton_kernel

    return triton_kernel
