"""Context-parallel plans: what `parallelize` splits, gathers, and keeps local, for each transformer class.

A plan is diffusers' own `_cp_plan` (module name -> `ContextParallelInput`s to split, or a `ContextParallelOutput`
to gather) plus what it does not say: which attention modules attend to tokens that are not split (they run
locally, untouched), which forward inputs become key masks of the split self-attention, and adapters for stock
processors that do not call `dispatch_attention_fn`. Models diffusers gives a `_cp_plan` need no file here unless
the plan needs a change; models it lacks get one small file each, named by their family in the model registry
(models/configs.py's `plan`), which the lookup reads by transformer class.
"""
from __future__ import annotations

from importlib import import_module
from typing import Any

import torch

from ...models.configs import FAMILIES
from .plan import ModelPlan


# diffusers plans whose attention the split cannot serve exactly, and why
REFUSED: dict[str, str] = {}


def plan_for(transformer: torch.nn.Module) -> ModelPlan:
    """The plan of a transformer: the one the model registry names for its class, else diffusers' `_cp_plan`."""
    name = type(transformer).__name__
    if REFUSED.get(name):
        raise ValueError(f"{name} is not supported by parallelize: {REFUSED[name]}; use diffusers' "
                         f"enable_parallelism for it")
    family = next((f for f in FAMILIES.values() if f.transformer_class == name and f.plan), None)
    if family is not None:
        return import_module(f"{__name__}.{family.plan}").PLAN
    cp_plan: Any = getattr(type(transformer), "_cp_plan", None)
    if cp_plan is None:
        ours = sorted({f.transformer_class for f in FAMILIES.values() if f.plan})
        raise ValueError(f"{name} has no context-parallel plan: parallelize takes a transformer with a diffusers "
                         f"_cp_plan (Flux, Flux.2, Wan, Qwen-Image, LTX, ...) or one of {ours}")
    return ModelPlan(cp_plan, "diffusers")


__all__ = ["ModelPlan", "plan_for"]
