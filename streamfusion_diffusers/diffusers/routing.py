"""Per attention module, who attends: `sp_attention` for self-attention over the split sequence, the stock
processor (locally, exactly, no transfer) for attention to tokens that are not split, `split_key_attention` for
whole queries over the split tokens.

diffusers' processors all end in `dispatch_attention_fn(..., backend=self._attention_backend,
parallel_config=self._parallel_config)`. Each routed module gets a copy of its processor naming our "streamfusion"
backend (processors/backend.py), with the module's route (context, shard state, name) in the `parallel_config`
slot that the dispatcher hands the backend. Nothing global changes: a module that is not routed runs as before,
and `unparallelize` puts the original processors back. Stock processors that call torch's SDPA themselves
(CogVideoX's) are replaced by the plan's adapter instead; Flux.1's and Flux.2's by twins that run RoPE in one pass
(`TWINS`).
"""
from __future__ import annotations

import copy
import fnmatch
from typing import Any

import torch
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
from diffusers.models.transformers.transformer_flux2 import Flux2AttnProcessor, Flux2ParallelSelfAttnProcessor

from ..context import ParallelContext
from .plans import ModelPlan
from .processors.backend import BACKEND, Route, backend_name, streamfusion_attention
from .processors.flux import FluxRotaryAttnProcessor
from .processors.flux2 import Flux2RotaryAttnProcessor, Flux2RotaryParallelSelfAttnProcessor
from .sharding import PlanState

# stock processor -> the twin installed in its place: the stock call step for step, with RoPE in one pass
# (kernels/rotary.py)
TWINS: dict[type, type] = {FluxAttnProcessor: FluxRotaryAttnProcessor, Flux2AttnProcessor: Flux2RotaryAttnProcessor,
                           Flux2ParallelSelfAttnProcessor: Flux2RotaryParallelSelfAttnProcessor}


def _is_local(name: str, module: torch.nn.Module, plan: ModelPlan) -> bool:
    return bool(getattr(module, "is_cross_attention", False)) or any(
        fnmatch.fnmatchcase(name, pattern) for pattern in plan.local_attention)


def _splits_keys(name: str, plan: ModelPlan) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in plan.split_key_attention)


def _routed(name: str, module: torch.nn.Module, processor: Any, plan: ModelPlan, route: Route) -> Any:
    """The processor module `name` runs under parallelize: ours, or the stock one refused with the fix."""
    stock = getattr(module, "_default_processor_cls", None)
    if type(processor) in plan.adapters:
        return plan.adapters[type(processor)](route.ctx, route.state)
    if processor is None or plan.adapters or (stock is not None and type(processor) is not stock
                                              and type(processor) not in plan.stock_processors):
        raise ValueError(f"{name} runs attention processor {type(processor).__name__}, which sequence parallelism "
                         f"would replace and lose; unload them (e.g. pipe.unload_ip_adapter()) before parallelize")
    if not hasattr(processor, "_attention_backend"):
        raise ValueError(f"{name} runs {type(processor).__name__}, which does not call diffusers' "
                         f"dispatch_attention_fn; its plan needs an adapter processor for it")
    twin = TWINS.get(type(processor))
    mine = twin() if twin is not None else copy.copy(processor)
    mine._attention_backend, mine._parallel_config = backend_name(), route
    return mine


def processors_of(transformer: torch.nn.Module) -> dict[str, Any]:
    """Every attention module's processor by "<module>.processor", as diffusers' `attn_processors` names them (read
    from the modules: transformers without diffusers' AttentionMixin, Z-Image's, have no such property)."""
    return {f"{name}.processor": module.processor for name, module in transformer.named_modules()
            if hasattr(module, "set_processor") and hasattr(module, "processor")}


def set_processors(transformer: torch.nn.Module, processors: dict[str, Any]) -> None:
    for key, processor in processors.items():
        transformer.get_submodule(key.removesuffix(".processor")).set_processor(processor)


def route_attention(transformer: torch.nn.Module, plan: ModelPlan, ctx: ParallelContext, state: PlanState
                    ) -> dict[str, Any]:
    """Route every self-attention over the split sequence to `sp_attention`; returns what to restore."""
    original = processors_of(transformer)
    chosen: dict[str, Any] = {}
    for key, processor in original.items():
        name = key.removesuffix(".processor")
        module = transformer.get_submodule(name)
        chosen[key] = (processor if _is_local(name, module, plan)
                       else _routed(name, module, processor, plan,
                                    Route(ctx, state, name, split_keys=_splits_keys(name, plan))))
    set_processors(transformer, chosen)
    return original


__all__ = ["TWINS", "processors_of", "route_attention", "set_processors"]
