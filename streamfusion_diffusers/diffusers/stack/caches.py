"""`--cache`: one of diffusers' cache hooks on every transformer of the pipeline, through its `enable_cache`.

Its hooks go on the blocks (First Block Cache, MagCache) or on the attention modules (TaylorSeer, Pyramid
Attention Broadcast); the ranks agree on every skip (skips.py says why each does). Enable a cache before
`parallelize`: a plan that splits the tokens at a block (Wan's `blocks.0`) must split them before the cache's
hook on that block sees them.
"""
from __future__ import annotations

from typing import Any

import torch

from .spec import Cache


def cache_config(cache: Cache, pipe: Any, transformer: torch.nn.Module) -> Any:
    """The diffusers config `--cache` names, for this pipeline and transformer."""
    from diffusers.hooks import (FirstBlockCacheConfig, MagCacheConfig, PyramidAttentionBroadcastConfig,
                                 TaylorSeerCacheConfig)
    from diffusers.hooks.mag_cache import FLUX_MAG_RATIOS

    if cache.name == "first-block":
        return FirstBlockCacheConfig(threshold=cache.value)
    if cache.name == "taylorseer":  # the Taylor factors in the model's dtype (diffusers' default: bfloat16)
        return TaylorSeerCacheConfig(cache_interval=int(cache.value), taylor_factors_dtype=transformer.dtype)
    if cache.name == "magcache":
        return MagCacheConfig(threshold=cache.value, num_inference_steps=cache.steps, mag_ratios=FLUX_MAG_RATIOS)
    if cache.name == "pab":
        return PyramidAttentionBroadcastConfig(spatial_attention_block_skip_range=int(cache.value),
                                               current_timestep_callback=lambda: pipe.current_timestep)
    raise ValueError(f"unknown cache {cache.name!r}")


def blocks(transformer: torch.nn.Module) -> int:
    """The transformer blocks diffusers' block caches hook (those of its block lists)."""
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS

    return sum(len(m) for name, m in transformer.named_children()
               if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(m, torch.nn.ModuleList))


def enable_cache(pipe: Any, transformers: list[torch.nn.Module], cache: Cache) -> str:
    """The cache on each transformer (each keeps its own state); what ran, as run.json says it."""
    for transformer in transformers:
        if getattr(transformer, "_streamfusion", None) is not None:
            raise ValueError("enable the cache before parallelize: a plan may split the tokens at a block, and "
                             "the cache's hook on that block must see them split")
        if cache.name == "first-block" and blocks(transformer) < 2:
            raise ValueError(f"--cache first-block needs two transformer blocks or more (the first decides whether "
                             f"the others run); {type(transformer).__name__} has {blocks(transformer)}: use "
                             f"--cache taylorseer")
        transformer.enable_cache(cache_config(cache, pipe, transformer))
    return str(cache)


__all__ = ["cache_config", "enable_cache"]
