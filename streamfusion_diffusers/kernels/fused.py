"""The fused multi-chunk kernel (paper Algorithm 2) for a device: Gluon's on Hopper, Triton's elsewhere.

On Hopper (compute capability 9.0) the Gluon kernel (gluon_attention.py) runs the warp-specialized schedule cuDNN
uses and comes close to it or passes it (cuDNN with LSE / fused: README.md's ranges, computed from the records by
benchmarks/figures.py). Other GPUs, Triton's CPU interpreter, and triton older than 3.6 (whose Gluon lacks what
the kernel uses) take triton_attention.py. Gluon's API still moves between triton releases, so the Gluon kernel's
first launch on a device is also its build check: if this triton cannot build it, that is said once and the
device takes the portable kernel. Both kernels read the same chunk tables (chunk_tables.py).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

GLUON_TRITON = (3, 6)  # the oldest triton whose Gluon has every Hopper operation the kernel uses

Kernel = Callable[..., None]

# The kernel each device runs, fixed by its first launch: a probe of the device and the installed triton, the same
# for every context (so module-level, like the other capability probes).
_launched: dict[torch.device, Kernel] = {}


def multi_chunk_attention(
    q_chunks: Sequence[Tensor],
    kv_chunks: Sequence[tuple[Tensor, Tensor]],
    states: Sequence[tuple[Tensor | None, Tensor]],
    outs: Sequence[Tensor],
    scale: float,
    finalize: bool,
) -> None:
    """One launch of Algorithm 2 by the device's kernel; arguments as triton_attention.multi_chunk_attention."""
    args = (q_chunks, kv_chunks, states, outs, scale, finalize)
    device = q_chunks[0].device
    if device in _launched:
        _launched[device](*args)
        return
    kernel = kernel_for(device)
    if kernel is not _portable():
        try:
            kernel(*args)
            _settle(device, kernel, "the Gluon Hopper kernel")
            return
        except Exception as err:  # noqa: BLE001  a build failure of this triton's Gluon: said once, then Triton
            if not _is_build_error(err):
                raise
            import triton

            logger.warning("fused attention on %s: the Gluon Hopper kernel does not build with triton %s (%s); "
                           "the portable Triton kernel runs instead", device, triton.__version__,
                           str(err).strip().splitlines()[-1][:200])
    kernel = _portable()
    kernel(*args)
    _settle(device, kernel, "the portable Triton kernel")


def _settle(device: torch.device, kernel: Kernel, name: str) -> None:
    _launched[device] = kernel
    logger.info("fused attention on %s: %s", device, name)


def kernel_for(device: torch.device) -> Kernel:
    """The fused kernel `device` runs: the one its first launch settled on, else the fastest it may run."""
    if device in _launched:
        return _launched[device]
    if device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0):
        import triton

        installed = tuple(int(part) for part in triton.__version__.split(".")[:2])
        if installed >= GLUON_TRITON:
            from .gluon_attention import multi_chunk_attention as gluon_kernel

            return gluon_kernel
        logger.info("fused attention on %s: the portable Triton kernel, as triton %s has no Gluon Hopper kernel "
                    "(pip install 'triton>=%d.%d' for it)", device, triton.__version__, *GLUON_TRITON)
    return _portable()


def _portable() -> Kernel:
    from .triton_attention import multi_chunk_attention as triton_kernel

    return triton_kernel


def _is_build_error(err: Exception) -> bool:
    """A failure to compile the kernel (the front end, or an MLIR pass), not a fault of the launch itself."""
    from triton.compiler.errors import CompilationError

    return isinstance(err, CompilationError) or "PassManager::run failed" in str(err)
