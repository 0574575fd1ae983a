"""streamfusion_diffusers: topology-aware sequence parallelism (Ulysses, Ring, USP, TAS, Torus) for diffusers."""
from __future__ import annotations

from .attention import sp_attention
from .config import Layout, ParallelConfig
from .context import ParallelContext, init_parallel, shutdown

__all__ = ["Layout", "ParallelConfig", "ParallelContext", "init_parallel", "shutdown", "sp_attention"]
__version__ = "0.1.0"
