"""torch.compile of a parallelized transformer, as diffusers users compile (issue 25).

`sp_attention` is the custom op `streamfusion::sp_attention` under the compiler (attention/op.py), so a
parallelized model compiles like a plain one, with `fullgraph=True`: `transformer.compile_repeated_blocks(
fullgraph=True)` where the model declares repeated blocks (Flux), `torch.compile(transformer, fullgraph=True)`
always (CogVideoX declares none). `compile_blocks` (issue 11, when attention broke the graph) remains as a
deprecated shortcut for the first; `repeated_blocks` also names CogVideoX's blocks for the bench's variants.
"""
from __future__ import annotations

import warnings
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
                         f"compile_blocks takes a Flux or CogVideoX transformer")
    return blocks


def compile_blocks(transformer: torch.nn.Module, **compile_kwargs: Any) -> list[torch.nn.Module]:
    """Deprecated: call `transformer.compile_repeated_blocks(fullgraph=True)` (diffusers), or
    `torch.compile(transformer, fullgraph=True)` for a model without declared repeated blocks. Compiles each
    repeated block in place with `compile_kwargs`; `uncompile_blocks` undoes it. Returns the compiled blocks."""
    warnings.warn("compile_blocks is deprecated: use transformer.compile_repeated_blocks(fullgraph=True), or "
                  "torch.compile(transformer, fullgraph=True) for CogVideoX (attention now compiles into the graph)",
                  DeprecationWarning, stacklevel=2)
    blocks = repeated_blocks(transformer)
    for block in blocks:
        block.compile(**compile_kwargs)
    return blocks


def uncompile_blocks(transformer: torch.nn.Module) -> None:
    """Run every block eager again (what `compile_blocks` or `compile_repeated_blocks` set, removed; Dynamo's
    caches kept for a later compile)."""
    for block in repeated_blocks(transformer):
        block._compiled_call_impl = None


__all__ = ["compile_blocks", "repeated_blocks", "uncompile_blocks"]
