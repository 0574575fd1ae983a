"""`apply_stack`: what the job stacks on its pipeline, in the order in which the parts compose."""
from __future__ import annotations

from typing import Any

from ..targets import transformers_of
from .caches import enable_cache
from .lora import load_adapters, load_loras
from .quantize import quantize
from .spec import Stack


def apply_stack(pipe: Any, stack: Stack) -> dict:
    """LoRAs first (fused into full-precision weights), then quantization of the fused weights, then the named
    adapters (unfused, off until a generation picks them), then the cache (before `parallelize`: caches.py says
    why). Returns what ran, for run.json and the responses; {} for none."""
    record: dict[str, Any] = {}
    transformers = transformers_of(pipe)
    if stack.loras:
        record["lora"] = load_loras(pipe, stack.loras)
    if stack.quantize:
        record["quantize"] = quantize(transformers, stack.quantize)
    if stack.adapters:
        record["adapters"] = load_adapters(pipe, stack.adapters)
    if stack.cache:
        record["cache"] = enable_cache(pipe, transformers, stack.cache)
    return record


__all__ = ["apply_stack"]
