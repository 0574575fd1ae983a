"""Triton is an optional dependency: the package imports and runs on CPU without it."""
from __future__ import annotations

import importlib.util
import os
from functools import cache


@cache
def has_triton() -> bool:
    """True when triton can be imported (its interpreter counts: TRITON_INTERPRET=1 runs kernels on CPU)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1), used by the CPU tests."""
    return os.environ.get("TRITON_INTERPRET") == "1"
