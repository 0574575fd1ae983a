"""torch.compile of the transformer blocks around our attention (issue 11; DynaFlow: compile what is static, keep
the schedule as data): everything in a block but attention (norms, modulation, projections, QK-norm, RoPE,
gates, MLP) is fused by the compiler, and attention stays eager.

The seam is `processors.base.attend`, marked `torch.compiler.disable`: Dynamo ends the graph before it and
resumes after it, so each block compiles into a graph before attention and one after, and the transfers, the
schedule's Python and the transport's streams never enter a graph. This is diffusers' regional compilation
(`compile_repeated_blocks`): one compile per block class, reused by every block of that class.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)

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
    """Compile each repeated block in place (`module.compile(**compile_kwargs)`, e.g. backend="inductor",
    mode="max-autotune-no-cudagraphs"); attention runs eager between the compiled parts. Call it after
    `parallelize` or before, in any order with it; `uncompile_blocks` undoes it. Returns the compiled blocks."""
    blocks = repeated_blocks(transformer)
    for block in blocks:
        block.compile(**compile_kwargs)
    logger.info("compiled %d blocks of %s (attention stays eager)", len(blocks), type(transformer).__name__)
    return blocks


def uncompile_blocks(transformer: torch.nn.Module) -> None:
    """Run every block eager again (what `compile_blocks` set, removed; Dynamo's caches kept for a later compile)."""
    for block in repeated_blocks(transformer):
        block._compiled_call_impl = None


__all__ = ["compile_blocks", "repeated_blocks", "uncompile_blocks"]
