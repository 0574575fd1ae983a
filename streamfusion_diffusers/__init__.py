"""streamfusion_diffusers: topology-aware sequence parallelism (Ulysses, Ring, USP, TAS, Torus) for diffusers.

The core (config, context, attention) needs torch only; `parallelize` and `unparallelize` need diffusers and are
imported on first use, so that a core-only install imports.
"""
from __future__ import annotations

import importlib
from typing import Any

from .attention import sp_attention
from .config import Layout, ParallelConfig
from .context import ParallelContext, init_parallel, shutdown

_LAZY = {"parallelize": ".parallel_pipeline", "unparallelize": ".parallel_pipeline"}  # name -> module (diffusers)

__all__ = ["Layout", "ParallelConfig", "ParallelContext", "init_parallel", "parallelize", "shutdown",
           "sp_attention", "unparallelize"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # once: later lookups find it without coming here
    return value
