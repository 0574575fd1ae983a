"""Swap the processors on a transformer's attention modules, and swap them back (no xfuser import here).

The hook is the attention processor, diffusers' own extension point: xfuser's attention wrappers (and, where
xfuser leaves a module unwrapped, diffusers' modules) call `self.processor(self, ...)`, and xfuser's processors
are where its `USP(...)` call lives. Replacing the processor object on each attention module touches this
model instance only: no xfuser function is patched, other models in the process keep xfuser's attention, and
`uninstall` puts the very same objects back.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..context import ParallelContext
from ..diffusers.processors import ShardState
from .layout import FAMILIES
from .processors import XDiTCogVideoXAttnProcessor, XDiTFluxAttnProcessor

PROCESSORS = {"flux": XDiTFluxAttnProcessor, "cogvideox": XDiTCogVideoXAttnProcessor}
MARK = "_streamfusion_xdit"


@dataclass
class Installed:
    """What `install` replaced, so that `uninstall` can put it back; the context stays reachable for callers."""

    ctx: ParallelContext
    saved: list[tuple[torch.nn.Module, Any, bool]]  # module, its processor, whether the module held it itself


def diffusers_model(transformer: torch.nn.Module) -> torch.nn.Module:
    """The diffusers model itself: xfuser's transformer wrappers hold it as `.module`."""
    inner = transformer.__dict__.get("_modules", {}).get("module")
    return inner if inner is not None else transformer


def model_name(transformer: torch.nn.Module) -> str:
    """The diffusers class the transformer is (or derives from) among the supported ones, else its own name."""
    model = diffusers_model(transformer)
    for cls in type(model).__mro__:
        if cls.__name__ in FAMILIES:
            return cls.__name__
    return type(model).__name__


def attention_modules(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The self-attention modules (or xfuser's wrappers around them), in block order."""
    model = diffusers_model(transformer)
    if FAMILIES.get(model_name(transformer)) == "flux":
        return [block.attn for block in (*model.transformer_blocks, *model.single_transformer_blocks)]
    return [block.attn1 for block in model.transformer_blocks]


def install(transformer: torch.nn.Module, ctx: ParallelContext, text_split: Callable[[], bool]) -> Installed:
    """Give every attention module of a Flux or CogVideoX transformer our processor, sharing one ShardState."""
    if transformer.__dict__.get(MARK) is not None:
        raise ValueError("streamfusion is already enabled on this pipeline; call disable(pipe) first")
    family = FAMILIES[model_name(transformer)]
    modules = attention_modules(transformer)
    if ctx.config.method != "auto":  # "auto" chooses (and builds) its layout at the first attention call
        ctx.mesh(modules[0].heads)  # collective: every rank builds its groups here, not inside the first forward
    state = ShardState()
    processor = PROCESSORS[family](ctx, text_split, state)
    installed = Installed(ctx, [(module, module.processor, "processor" in vars(module)) for module in modules])
    for module in modules:
        module.processor = processor
    transformer.__dict__[MARK] = installed
    return installed


def uninstall(transformer: torch.nn.Module) -> None:
    """Put back the processors `install` replaced, each where it was (the attention module's own attribute or,
    behind an xfuser wrapper that delegates attributes, the wrapped module's)."""
    installed: Installed | None = transformer.__dict__.pop(MARK, None)
    if installed is None:
        raise ValueError("streamfusion is not enabled on this pipeline")
    for module, processor, own in installed.saved:
        if own:
            module.processor = processor
        else:  # it was the wrapped module's, found through the wrapper's __getattr__: show that one again
            del module.__dict__["processor"]
