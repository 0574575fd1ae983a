"""The "streamfusion" attention backend of diffusers' `dispatch_attention_fn`: its registration, the route a
processor hands it, and the call, `sp_attention` through `attend`.

diffusers' processors end in `dispatch_attention_fn(..., backend=self._attention_backend,
parallel_config=self._parallel_config)`, which calls the backend registered under that name with the
`parallel_config` as `_parallel_config`. A processor naming this backend and carrying a `Route` there runs its
attention sequence-parallel: the stock processors `parallelize` routes (routing.py) and our Flux adapter for
`set_attn_processor` users (flux.py) alike, one code path.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import diffusers
import torch
import torch.distributed as dist
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry, dispatch_attention_fn
from torch import Tensor

from ...attention.split_keys import split_key_attention
from ...context import ParallelContext
from .base import ShardState, attend

BACKEND = "streamfusion"


@dataclass(frozen=True)
class Route:
    """What the backend needs of one processor: the context, the shard state the split hooks keep (or the
    caller's) and the module's name for messages. split_keys: its queries are whole on every rank and its keys
    the split image/video tokens (`split_key_attention`), not rows of the split sequence."""

    ctx: ParallelContext
    state: ShardState
    module: str
    split_keys: bool = False


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
    if route.split_keys:
        return _split_keys(query, key, value, route, attn_mask, scale)
    key_mask = None
    if attn_mask is not None and (getattr(route.state, "key_padding", False) or not (
            getattr(route.state, "masks_checked", False) or _keeps_all_everywhere(attn_mask, route))):
        key_mask = _key_mask(attn_mask, query.shape[0], key.shape[1], route.module)
    if layout is not None:
        rows = layout.joint + layout.seq_lens[layout.rank]
        if query.shape[1] != rows or key.shape[1] != rows:
            raise ValueError(f"{route.module} attends {query.shape[1]} queries to {key.shape[1]} keys, but this "
                             f"rank holds {rows} rows of the split sequence: list the module in its plan's "
                             f"local_attention (attention to tokens that are not split)")
    return attend(query, key, value, route.ctx, route.state, scale, key_mask)


def _split_keys(query: Tensor, key: Tensor, value: Tensor, route: Route, attn_mask: Tensor | None,
                scale: float | None) -> Tensor:
    """Whole queries over this rank's split image/video keys, merged over the ranks."""
    layout = route.state.layout
    if attn_mask is not None and not _keeps_all_everywhere(attn_mask, route):
        raise ValueError(f"{route.module} got an attention mask: its keys are split over the ranks, so it attends "
                         f"them unmasked; call the transformer without one")
    if layout is not None and key.shape[1] != layout.image_lens[layout.rank]:
        raise ValueError(f"{route.module} attends {key.shape[1]} keys, but this rank holds "
                         f"{layout.image_lens[layout.rank]} split image/video tokens: list only attention over the "
                         f"split tokens in its plan's split_key_attention")
    return split_key_attention(query, key, value, route.ctx, scale)


def _keeps_all(mask: Tensor) -> bool:
    """A boolean mask of all True, or an additive one of all zeros, changes no softmax."""
    return bool(mask.all()) if mask.dtype == torch.bool else not bool(mask.any())


def _keeps_all_everywhere(mask: Tensor, route: Route) -> bool:
    """Whether every rank's slice of a mask no hook checked keeps all its keys. One rank's slice may while a peer's
    does not (Z-Image's padded batch: the padding lies on the last ranks); ranks deciding apart would run different
    collectives (the mask's gather, or a refusal, on some) and wait for each other until the group's timeout.
    Decided once per forward: every layer gets the same view of the one mask the split hook cut (same memory,
    shape and strides), so the host read and the ranks' agreement are not repeated at each layer. The verdict
    holds the mask until the forward ends, so no other tensor can take its memory meanwhile."""
    verdicts: dict | None = getattr(route.state, "mask_verdicts", None)
    seen = (mask.data_ptr(), tuple(mask.shape), mask.stride(), mask.dtype)
    if verdicts is not None and seen in verdicts:
        return verdicts[seen][0]
    kept = _keeps_all(mask)
    group = route.ctx.cfg.sp
    if group.size > 1:
        everywhere = torch.tensor([int(kept)], device=mask.device)
        dist.all_reduce(everywhere, op=dist.ReduceOp.MIN, group=group.pg)
        kept = bool(everywhere)
    if verdicts is not None:
        verdicts[seen] = (kept, mask)
    return kept


def _key_mask(mask: Tensor, batch: int, keys: int, module: str) -> Tensor:
    """An attention mask that leaves some keys out of every query's softmax (padded prompts), as [B, keys] bool;
    any other mask (per query, or an additive bias) refused: sequence-parallel attention takes key padding only."""
    if mask.dtype != torch.bool:
        if bool(((mask != 0) & (mask != float("-inf"))).any()):
            raise ValueError(f"{module} got an additive attention bias: sequence-parallel attention takes key "
                             f"masks only (which keys every query attends)")
        mask = mask == 0
    if mask.shape[-1] != keys or mask.numel() not in (keys, batch * keys) or (mask.dim() > 2 and mask.shape[-2] != 1):
        raise ValueError(f"{module} got an attention mask of shape {tuple(mask.shape)}: sequence-parallel attention "
                         f"takes one that masks keys alike for every query and head, [B, 1, 1, {keys}] or "
                         f"[B, {keys}]")
    return mask.reshape(-1, keys).expand(batch, keys)


def backend_name() -> AttentionBackendName:
    """The "streamfusion" member of diffusers' AttentionBackendName, registered with `streamfusion_attention` on
    first use.

    diffusers (0.42.1) offers no way to add a backend: its registry's `register` decorator takes a member of the
    AttentionBackendName enum, and `set_attention_backend` / the `attention_backend` context manager look names
    up in it, but the enum cannot grow. So the member is added here as Enum itself adds one: the one place this
    package writes diffusers' private (Enum) fields, after checking that diffusers still has the shape it relies
    on; tests/test_backend.py fails loudly when a diffusers release changes it.
    """
    member = AttentionBackendName._value2member_map_.get(BACKEND)
    if member is None:
        _check_diffusers()
        member = str.__new__(AttentionBackendName, BACKEND)
        member._name_, member._value_ = BACKEND.upper(), BACKEND
        AttentionBackendName._member_map_[member._name_] = member
        AttentionBackendName._value2member_map_[BACKEND] = member
        AttentionBackendName._member_names_.append(member._name_)
        _AttentionBackendRegistry.register(member)(streamfusion_attention)
    return member


def _check_diffusers() -> None:
    """What the registration relies on: a str-valued backend enum with Enum's member tables, a registry with its
    `register` decorator and backend table, and a dispatcher that hands `parallel_config` to the backend."""
    dispatcher = inspect.signature(dispatch_attention_fn).parameters
    found: dict[str, Any] = {
        "AttentionBackendName is a str Enum": issubclass(AttentionBackendName, str),
        "its member tables": all(hasattr(AttentionBackendName, f) for f in
                                 ("_member_map_", "_value2member_map_", "_member_names_")),
        "_AttentionBackendRegistry.register and _backends": callable(getattr(_AttentionBackendRegistry, "register",
                                                                             None))
        and isinstance(getattr(_AttentionBackendRegistry, "_backends", None), dict),
        "dispatch_attention_fn(backend=, parallel_config=)": {"backend", "parallel_config"} <= set(dispatcher),
    }
    missing = [what for what, ok in found.items() if not ok]
    if missing:
        raise RuntimeError(f"diffusers {diffusers.__version__} changed its attention backend registry "
                           f"({', '.join(missing)} no longer as streamfusion_diffusers registers its backend); "
                           f"install diffusers==0.42.1, the version it is tested with")


__all__ = ["BACKEND", "Route", "backend_name", "streamfusion_attention"]
