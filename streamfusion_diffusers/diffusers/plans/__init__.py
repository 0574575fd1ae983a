"""Context-parallel plans: what `parallelize` splits, gathers, and keeps local, for each transformer class.

A plan is diffusers' own `_cp_plan` (module name -> `ContextParallelInput`s to split, or a `ContextParallelOutput`
to gather) plus what it does not say: which attention modules attend to tokens that are not split (they run
locally, untouched), which forward inputs become key masks of the split self-attention, and adapters for stock
processors that do not call `dispatch_attention_fn`. Models diffusers gives a `_cp_plan` need no file here unless
the plan needs a change; models it lacks get one small file each, registered by class name (as Cache-DiT does).
"""
from __future__ import annotations

from typing import Any

import torch
from .plan import ModelPlan


def _ours() -> dict[str, ModelPlan]:
    from . import cogvideox, hunyuan_video, ltx
    return {"CogVideoXTransformer3DModel": cogvideox.PLAN, "HunyuanVideoTransformer3DModel": hunyuan_video.PLAN,
            "LTXVideoTransformer3DModel": ltx.PLAN}


# diffusers' plan as shipped, with the forward inputs that mask the split self-attention's keys
DIFFUSERS_KEY_MASKS = {"QwenImageTransformer2DModel": ("encoder_hidden_states_mask",)}  # each dropped when full


# diffusers plans whose attention the split cannot serve exactly, and why
REFUSED = {
    "LTX2VideoTransformer3DModel": "its audio stream (whole on every rank) cross-attends the split video tokens",
    "MiniMaxH3Transformer3DModel": "its video and audio outputs are picked out of the split sequence by token tags, "
                                   "so their per-rank counts are no plain split",
}


def plan_for(transformer: torch.nn.Module) -> ModelPlan:
    """The plan of a transformer: ours for its class if we have one, else diffusers' `_cp_plan`."""
    name = type(transformer).__name__
    if REFUSED.get(name):
        raise ValueError(f"{name} is not supported by parallelize: {REFUSED[name]}; use diffusers' "
                         f"enable_parallelism for it")
    ours = _ours()
    if name in ours:
        return ours[name]
    cp_plan: Any = getattr(type(transformer), "_cp_plan", None)
    if cp_plan is None:
        supported = sorted(ours)
        raise ValueError(f"{name} has no context-parallel plan: parallelize takes a transformer with a diffusers "
                         f"_cp_plan (Flux, Flux.2, Wan, Qwen-Image, LTX, ...) or one of {supported}")
    masks = DIFFUSERS_KEY_MASKS.get(name, ())
    return ModelPlan(cp_plan, "diffusers", key_masks=masks, drop_full_masks=bool(masks))


__all__ = ["ModelPlan", "plan_for"]
