"""streamfusion_diffusers: topology-aware sequence parallelism (Ulysses, Ring, USP, TAS, Torus) for diffusers.

The public API, wired from the floors: the core (context, attention) and, for method="auto", the layout choice.
"""
from __future__ import annotations

from collections.abc import Sequence

from . import _moved
from .attention import sp_attention
from .choice.choose import auto_layout
from .config import Layout, ParallelConfig
from .context import ParallelContext, shutdown
from .context import init_parallel as _bind
from .mesh import GroupCache

_moved.install()  # old import paths of moved modules, for one release


def init_parallel(config: ParallelConfig | None = None, worlds: Sequence[Sequence[int]] | None = None,
                  groups: GroupCache | None = None) -> ParallelContext:
    """Bind a ParallelConfig to the running job (context.init_parallel), with the layout choice as method
    "auto"'s chooser. groups: another context's `groups`, to reuse its process groups (a job comparing many
    layouts creates each one's groups once)."""
    return _bind(config, worlds, chooser=auto_layout, groups=groups)


__all__ = ["Layout", "ParallelConfig", "ParallelContext", "init_parallel", "shutdown", "sp_attention"]
__version__ = "0.1.0"
