"""Per attention module, who attends: `sp_attention` for self-attention over the split sequence, the stock
processor (locally, exactly, no transfer) for attention to tokens that are not split.

diffusers' processors all end in `dispatch_attention_fn(..., backend=self._attention_backend,
parallel_config=self._parallel_config)`. We register one more backend there, "streamfusion", and give each
routed module a copy of its processor naming that backend, with the module's route (context, shard state, name)
in the `parallel_config` slot that the dispatcher hands the backend. Nothing global changes: a module that is not
routed runs as before, and `unroute` puts the original processors back. Stock processors that call torch's SDPA
themselves (CogVideoX's) are replaced by the plan's adapter instead.
"""
from __future__ import annotations

import copy
import fnmatch
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
from torch import Tensor

from ..context import ParallelContext
from .plans import ModelPlan
from .processors.base import attend
from .sharding import PlanState

BACKEND = "streamfusion"


@dataclass(frozen=True)
class Route:
    """What the backend needs of one routed module: the context, the shard state the split hooks keep, its name."""

    ctx: ParallelContext
    state: PlanState
    module: str


def streamfusion_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None,
                           dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                           enable_gqa: bool = False, _parallel_config: Route | None = None) -> Tensor:
    """diffusers' attention backend signature ([B, L, H, D] in and out), computed by `sp_attention`."""
    route = _parallel_config
    if not isinstance(route, Route):
        raise ValueError("the streamfusion attention backend was called without its route: it runs only in modules "
                         "parallelize() routed, through their processor (paths that call dispatch_attention_fn "
                         "themselves, such as Flux.2's reference-image KV attention, are not supported)")
    if dropout_p or is_causal or enable_gqa:
        raise ValueError(f"{route.module}: sequence-parallel attention is non-causal, without dropout or GQA")
    layout = route.state.layout
    if attn_mask is not None and not route.state.masks_checked and not _keeps_all(attn_mask):
        raise ValueError(f"{route.module} got an attention mask that masks out keys: sequence-parallel attention "
                         f"takes none; call the transformer without attention_mask / padded prompts")
    if layout is not None:
        rows = layout.joint + layout.seq_lens[layout.rank]
        if query.shape[1] != rows or key.shape[1] != rows:
            raise ValueError(f"{route.module} attends {query.shape[1]} queries to {key.shape[1]} keys, but this "
                             f"rank holds {rows} rows of the split sequence: list the module in its plan's "
                             f"local_attention (attention to tokens that are not split)")
    return attend(query, key, value, route.ctx, route.state, scale)


def _keeps_all(mask: Tensor) -> bool:
    """A boolean mask of all True, or an additive one of all zeros, changes no softmax."""
    return bool(mask.all()) if mask.dtype == torch.bool else not bool(mask.any())


def backend_name() -> AttentionBackendName:
    """The "streamfusion" member of diffusers' backend enum, added and registered on first use."""
    member = AttentionBackendName._value2member_map_.get(BACKEND)
    if member is None:  # the enum has no public way to grow; add the member as Enum itself does
        member = str.__new__(AttentionBackendName, BACKEND)
        member._name_, member._value_ = BACKEND.upper(), BACKEND
        AttentionBackendName._member_map_[member._name_] = member
        AttentionBackendName._value2member_map_[BACKEND] = member
        AttentionBackendName._member_names_.append(member._name_)
        _AttentionBackendRegistry.register(member)(streamfusion_attention)
    return member


def _is_local(name: str, module: torch.nn.Module, plan: ModelPlan) -> bool:
    return bool(getattr(module, "is_cross_attention", False)) or any(
        fnmatch.fnmatchcase(name, pattern) for pattern in plan.local_attention)


def _routed(name: str, module: torch.nn.Module, processor: Any, plan: ModelPlan, route: Route) -> Any:
    """The processor module `name` runs under parallelize: ours, or the stock one refused with the fix."""
    stock = getattr(module, "_default_processor_cls", None)
    if type(processor) in plan.adapters:
        return plan.adapters[type(processor)](route.ctx, route.state)
    if processor is None or (stock is not None and type(processor) is not stock) or plan.adapters:
        raise ValueError(f"{name} runs attention processor {type(processor).__name__}, which sequence parallelism "
                         f"would replace and lose; unload them (e.g. pipe.unload_ip_adapter()) before parallelize")
    if not hasattr(processor, "_attention_backend"):
        raise ValueError(f"{name} runs {type(processor).__name__}, which does not call diffusers' "
                         f"dispatch_attention_fn; its plan needs an adapter processor for it")
    mine = copy.copy(processor)
    mine._attention_backend, mine._parallel_config = backend_name(), route
    return mine


def route_attention(transformer: torch.nn.Module, plan: ModelPlan, ctx: ParallelContext, state: PlanState
                    ) -> dict[str, Any]:
    """Route every self-attention over the split sequence to `sp_attention`; returns what to restore."""
    original = dict(transformer.attn_processors)
    chosen: dict[str, Any] = {}
    for key, processor in original.items():
        name = key.removesuffix(".processor")
        module = transformer.get_submodule(name)
        chosen[key] = (processor if _is_local(name, module, plan)
                       else _routed(name, module, processor, plan, Route(ctx, state, name)))
    transformer.set_attn_processor(chosen)
    return original


__all__ = ["BACKEND", "Route", "backend_name", "route_attention", "streamfusion_attention"]
