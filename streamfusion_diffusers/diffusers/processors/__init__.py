"""Attention processors that run diffusers' Flux and CogVideoX attention through `sp_attention`.

    ctx = init_parallel(ParallelConfig(method="torus"))
    transformer.set_attn_processor(FluxSPAttnProcessor(ctx))   # you shard the inputs yourself, equal slices
    parallelize(transformer, ctx)                               # or: processors plus input/output sharding
"""
from __future__ import annotations

from .base import ShardState, TokenLayout
from .cogvideox import CogVideoXSPAttnProcessor
from .flux import FluxSPAttnProcessor

__all__ = ["CogVideoXSPAttnProcessor", "FluxSPAttnProcessor", "ShardState", "TokenLayout"]
