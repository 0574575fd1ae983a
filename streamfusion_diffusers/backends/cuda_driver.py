"""The CUDA driver API through cuda-bindings (which CUDA torch wheels bring): stream memory operations and copies
that torch does not expose, for the emulated link's copy-engine bookings and the probe benchmarks/ce_a2a_probe.py."""
from __future__ import annotations


def driver():
    """cuda-bindings' driver module (ImportError without cuda-bindings)."""
    try:
        from cuda.bindings import driver as module
    except ImportError:
        from cuda import cuda as module  # cuda-python before 12.6
    return module


def check(result: tuple) -> tuple:
    """A driver call's results after its error code; raises on an error."""
    err, *rest = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return tuple(rest)


__all__ = ["check", "driver"]
