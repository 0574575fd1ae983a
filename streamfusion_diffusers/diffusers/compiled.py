"""torch.compile of a parallelized transformer, as diffusers users compile.

`sp_attention` is the custom op `streamfusion::sp_attention` under the compiler (attention/op.py), so a
parallelized model compiles like a plain one, with `fullgraph=True`: `transformer.compile_repeated_blocks(
fullgraph=True)` where the model declares repeated blocks (Flux), `torch.compile(transformer, fullgraph=True)`
always (CogVideoX declares none). Here: `generate --compile`'s compile of every transformer's repeated blocks,
with CogVideoX's named, and its undoing for the bench's eager variants.
"""
from __future__ import annotations

from typing import Any

import torch

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


def compile_transformers(target: Any) -> int:
    """`generate --compile`: every transformer's repeated blocks through torch.compile(fullgraph=True), as
    diffusers' `compile_repeated_blocks` does (CogVideoX's named here), under a CUDA graph where graphs are on.
    A block that recompiles past RECOMPILE_LIMIT raises, naming why (a guard that keeps failing), instead of
    running on for minutes. Returns the number of blocks compiled."""
    torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    torch._dynamo.config.fail_on_recompile_limit_hit = True
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


__all__ = ["RECOMPILE_LIMIT", "compile_transformers", "repeated_blocks", "uncompile_blocks"]
