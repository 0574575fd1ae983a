"""streamfusion_diffusers: topology-aware sequence parallelism (Ulysses, Ring, USP, TAS, Torus) for diffusers.

The public API, wired from the floors: the core (context, attention) and, for method="auto", the layout choice.
Every name is imported on first use (PEP 562): importing the package imports neither torch nor diffusers, so the
`streamfusion` command can start its ranks' fork server before its own imports (runtime/fork_server.py), and a
core-only install imports without diffusers until `parallelize` is asked for.
"""
from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .core.logs import quiet_other_ranks

if TYPE_CHECKING:
    from .context import ParallelContext
    from .core.config import ParallelConfig
    from .core.mesh import GroupCache

quiet_other_ranks()  # under a launcher, before a script imports diffusers (and with it transformers)

_LAZY = {"sp_attention": ".attention", "Layout": ".core.config", "ParallelConfig": ".core.config",
         "ParallelContext": ".context", "shutdown": ".context",
         "parallelize": ".diffusers.parallel_pipeline", "unparallelize": ".diffusers.parallel_pipeline"}  # -> module


def init_parallel(config: ParallelConfig | None = None, worlds: Sequence[Sequence[int]] | None = None,
                  groups: GroupCache | None = None) -> ParallelContext:
    """Bind a ParallelConfig to the running job (context.init_parallel), with the layout choice as method
    "auto"'s chooser. groups: another context's `groups`, to reuse its process groups (a job comparing many
    layouts creates each one's groups once)."""
    from .choice.choose import auto_layout
    from .context import init_parallel as bind

    return bind(config, worlds, chooser=auto_layout, groups=groups)


__all__ = ["Layout", "ParallelConfig", "ParallelContext", "init_parallel", "parallelize", "shutdown",
           "sp_attention", "unparallelize"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value  # once: later lookups find it without coming here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
