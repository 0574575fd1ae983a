"""Triton is an optional dependency: the package imports and runs on CPU without it."""
from __future__ import annotations

import importlib.util
from functools import cache


@cache  # a capability probe of the installed packages: the same for every context
def has_triton() -> bool:
    """True when triton can be imported (its interpreter counts: TRITON_INTERPRET=1 runs kernels on CPU)."""
    return importlib.util.find_spec("triton") is not None


def is_build_error(err: Exception) -> bool:
    """A Triton kernel's failure to compile (the front end, or an MLIR pass), not a fault of its launch."""
    from triton.compiler.errors import CompilationError

    return isinstance(err, CompilationError) or "PassManager::run failed" in str(err)
