"""The fused multi-chunk kernel (paper Algorithm 2) for a device: Gluon's on Hopper, Triton's elsewhere.

On Hopper (compute capability 9.0) the Gluon kernel (gluon_attention.py) runs the warp-specialized schedule cuDNN
uses and comes close to it or passes it (cuDNN with LSE / fused: BENCHMARKS.md's kernel ranges, computed from the
records by benchmarks/figures.py). Other GPUs, Triton's CPU interpreter, and triton older than 3.6 (whose Gluon lacks what
the kernel uses) take triton_attention.py. Gluon's API still moves between triton releases, so the Gluon kernel's
first launch of each variant on a device is also that build's check: if this triton cannot build it, that is said
once and the variant (dtype, head dim, state loaded, finalized) takes the portable kernel. Both kernels read the same chunk
tables (chunk_tables.py), which check on the host the layouts they address.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ..core.logs import say_once
from .optional import is_build_error

logger = logging.getLogger(__name__)

GLUON_TRITON = (3, 6)  # the oldest triton whose Gluon has every Hopper operation the kernel uses

Kernel = Callable[..., None]


class Variant(NamedTuple):
    """What one compiled build of a fused kernel is specialised for: each builds (or fails to) on its own."""

    dtype: torch.dtype
    head_dim: int
    load_state: bool
    finalize: bool


# The kernel each variant runs on each device, fixed by that variant's first launch: a probe of the device and the
# installed triton, the same for every context (so module-level, like the other capability probes).
_launched: dict[tuple[torch.device, Variant], Kernel] = {}


def multi_chunk_attention(
    q_chunks: Sequence[Tensor],
    kv_chunks: Sequence[tuple[Tensor, Tensor]],
    states: Sequence[tuple[Tensor | None, Tensor]],
    outs: Sequence[Tensor],
    scale: float,
    finalize: bool,
) -> None:
    """One launch of Algorithm 2 by the device's kernel; arguments as triton_attention.multi_chunk_attention.

    The Gluon kernel's first launch of each variant (dtype, head dim, state loaded, finalized: each a build of
    its own) is that variant's build check: one that does not build is said once and runs the portable kernel."""
    args = (q_chunks, kv_chunks, states, outs, scale, finalize)
    q = q_chunks[0]
    variant = Variant(q.dtype, q.shape[-1], states[0][0] is not None, finalize)
    key = (q.device, variant)
    if key in _launched:
        _launched[key](*args)
        return
    kernel = kernel_for(q.device)
    if kernel is not _portable():
        try:
            kernel(*args)
            _settle(key, kernel, "the Gluon Hopper kernel")
            return
        except Exception as err:  # noqa: BLE001  a build failure of this triton's Gluon: said once, then Triton
            if not is_build_error(err):
                raise
            import triton

            logger.warning("fused attention on %s, %s: the Gluon Hopper kernel does not build with triton %s "
                           "(%s); the portable Triton kernel runs this variant instead", q.device, variant,
                           triton.__version__, str(err).strip().splitlines()[-1][:200])
    kernel = _portable()
    kernel(*args)
    _settle(key, kernel, "the portable Triton kernel")


def _settle(key: tuple[torch.device, Variant], kernel: Kernel, name: str) -> None:
    _launched[key] = kernel
    logger.info("fused attention on %s, %s: %s", *key, name)


def kernel_for(device: torch.device, variant: Variant | None = None) -> Kernel:
    """The fused kernel `device` runs: for a variant, the one its first launch settled on; else (or before that
    launch) the fastest the device may run."""
    if (device, variant) in _launched:
        return _launched[(device, variant)]
    if device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0):
        import triton

        installed = tuple(int(part) for part in triton.__version__.split(".")[:2])
        if installed >= GLUON_TRITON:
            from .gluon_attention import multi_chunk_attention as gluon_kernel

            return gluon_kernel
        say_once(logger, logging.INFO, "fused attention on %s: the portable Triton kernel, as triton %s has no "
                 "Gluon Hopper kernel (pip install 'triton>=%d.%d' for it)", device, triton.__version__,
                 *GLUON_TRITON)
    return _portable()


def _portable() -> Kernel:
    from .triton_attention import multi_chunk_attention as triton_kernel

    return triton_kernel

