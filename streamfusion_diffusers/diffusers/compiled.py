"""torch.compile of a parallelized transformer, as diffusers users compile.

`sp_attention` is the custom op `streamfusion::sp_attention` under the compiler (attention/op.py), so a
parallelized model compiles like a plain one, with `fullgraph=True`: `transformer.compile_repeated_blocks(
fullgraph=True)` where the model declares repeated blocks (Flux), `torch.compile(transformer, fullgraph=True)`
always (CogVideoX declares none). Here: `generate --compile`'s compile of every transformer's repeated blocks,
with CogVideoX's named, and its undoing for the bench's eager variants; the folder inductor keeps what it compiled
in (`--compile-cache`: a restart reads it back instead of compiling again); and each dynamo compile timed as
one-time work ("compile" in a run record's one_time_s), so that a served request that compiled says so.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from ..core.one_time import count

# diffusers' FluxTransformer2DModel names its repeated blocks; CogVideoX (0.42) does not, so they are named here
REPEATED_BLOCKS = ("FluxTransformerBlock", "FluxSingleTransformerBlock", "CogVideoXBlock")


def repeated_blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer's repeated blocks: its own `_repeated_blocks` classes, else the known ones."""
    names = tuple(getattr(transformer, "_repeated_blocks", None) or REPEATED_BLOCKS)
    blocks = [m for m in transformer.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"{type(transformer).__name__} has no blocks of {', '.join(names)} to compile; "
                         f"pass a Flux or CogVideoX transformer")
    return blocks


RECOMPILE_LIMIT = 8  # recompiles of one block's code past which a compile raises with dynamo's reason
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"  # inductor's cache folder, read at each compile


def default_cache() -> str:
    """`--compile-cache`'s default: streamfusion/inductor under the user's cache folder ($XDG_CACHE_HOME, else
    ~/.cache), which outlives the process and /tmp's cleaning (inductor's own default lies under /tmp). Not
    $TORCHINDUCTOR_CACHE_DIR: inductor writes its /tmp default there at its first use in a process."""
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return str((home / "streamfusion" / "inductor").expanduser().resolve())


def use_cache(folder: str) -> None:
    """Keep this process's compiles under `folder`, before anything compiles: inductor's FX graph cache (its
    generated code and kernels), the AOT autograd cache, the Triton kernels and dynamo's profile of the
    dimensions it found dynamic, so that a restart on the same folder compiles from them."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    os.makedirs(folder, exist_ok=True)
    os.environ[CACHE_ENV] = folder
    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True


_COMPILING: list[float] = []  # when dynamo's compile running now began (its callbacks come in pairs, never nested)


def _compile_started(_: Any) -> None:
    _COMPILING.append(time.perf_counter())


def _compile_ended(_: Any) -> None:
    count("compile", time.perf_counter() - _COMPILING.pop())


def compile_transformers(target: Any, cache: str | None = None) -> int:
    """`generate --compile`: every transformer's repeated blocks through torch.compile(fullgraph=True), as
    diffusers' `compile_repeated_blocks` does (CogVideoX's named here), under a CUDA graph where graphs are on,
    what inductor compiles kept under `cache` (`use_cache`). A block that recompiles past RECOMPILE_LIMIT raises,
    naming why (a guard that keeps failing), instead of running on for minutes. Every compile's seconds are
    counted as one-time work "compile". Returns the number of blocks compiled."""
    if cache is not None:
        use_cache(cache)
    torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    # the layout's rows per rank are host ints on the processors: symbolic once a second size came, as the tokens
    torch._dynamo.config.allow_unspec_int_on_nn_module = True
    callbacks = torch._dynamo.callback.callback_handler
    if _compile_started not in callbacks.start_callbacks:
        torch._dynamo.callback.on_compile_start(_compile_started)
        torch._dynamo.callback.on_compile_end(_compile_ended)
    compiled = 0
    for name in ("transformer", "transformer_2"):
        transformer = getattr(target, name, None)
        if transformer is None:
            continue
        for block in repeated_blocks(transformer):
            block.compile(fullgraph=True)
            compiled += 1
    return compiled


def uncompile_blocks(transformer: torch.nn.Module) -> None:
    """Run every block eager again (what `compile_transformers` or `compile_repeated_blocks` set, removed; Dynamo's
    caches kept for a later compile)."""
    for block in repeated_blocks(transformer):
        block._compiled_call_impl = None


__all__ = ["CACHE_ENV", "RECOMPILE_LIMIT", "compile_transformers", "default_cache", "repeated_blocks",
           "uncompile_blocks", "use_cache"]
