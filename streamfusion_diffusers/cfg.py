"""Classifier-free-guidance parallelism: the two guidance branches of a step computed at once, each by its own half
of the ranks.

CogVideoX's pipeline calls its transformer once per step with the batch [uncond ; cond]. `CfgSplitHook`, the
outermost hook `parallelize` puts on the transformer when cfg > 1, hands branch b the b-th half of every batched
argument (the SP split hook inside it then cuts that half's tokens over the branch's SP group), and all-gathers
the noise prediction across the branches, so the pipeline's guidance math sees the whole batch as before. The
branches exchange one noise prediction per step; their attention traffic stays inside each branch, which
`config.cfg_shape` places on its own machines when it can.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
from diffusers.hooks import ModelHook

from .context import ParallelContext
from .sequence import gather

logger = logging.getLogger(__name__)

CFG_HOOK = "streamfusion_cfg"
# forward arguments that carry the guidance batch on dim 0 (Flux and CogVideoX); ids, rotary tables are shared
BATCHED = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance", "ofs")


class CfgSplitHook(ModelHook):
    """Before the forward: keep this branch's part of the batch. After: all-gather the branches' outputs."""

    def __init__(self, ctx: ParallelContext):
        super().__init__()
        self.ctx = ctx
        self.signature: inspect.Signature | None = None
        self.batch: int | None = None  # the whole batch of the current call, when it was split
        self.warned = False

    def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        self.signature = inspect.signature(module.forward)
        return module

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        bound = self.signature.bind(*args, **kwargs)
        arguments = bound.arguments
        batch = arguments["hidden_states"].shape[0]
        degree = self.ctx.resolve_cfg(batch)
        self.batch = None
        if degree == 1:
            return args, kwargs
        if batch % degree:
            if not self.warned and self.ctx.global_rank == 0:
                logger.warning("cfg=%d but the transformer got batch %d (guidance off?): every branch computes the "
                               "whole batch; use cfg=1 (or 'auto') for unguided runs", degree, batch)
            self.warned = True
            return args, kwargs
        self.batch = batch
        per, branch = batch // degree, self.ctx.cfg.cfg.index
        for name in BATCHED:
            value = arguments.get(name)
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == batch:
                arguments[name] = value[branch * per:(branch + 1) * per]
        return bound.args, bound.kwargs

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        if self.batch is None:
            return output
        degree = self.ctx.cfg.degree
        sample = output[0] if isinstance(output, tuple) else output.sample
        whole = gather(sample, [self.batch // degree] * degree, self.ctx.cfg.cfg.pg, dim=0)
        if isinstance(output, tuple):
            return (whole, *output[1:])
        output.sample = whole
        return output


__all__ = ["CFG_HOOK", "CfgSplitHook"]
