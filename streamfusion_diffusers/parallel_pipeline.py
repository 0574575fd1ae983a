"""`parallelize` / `unparallelize`: sequence parallelism around a diffusers Flux or CogVideoX pipeline or transformer.

`parallelize` installs the sequence-parallel processors and the token split (`sharding.py`: a split hook on the
transformer, for CogVideoX a patch-embedding hook, a gather hook on `proj_out`), and, as asked, the CFG split
(`cfg.py`), TokenWeave waves (`wave_blocks.py`, deprecated), a CUDA graph of the whole forward (`graphs.py`) and the VAE
decode split (`vae.py`). The inputs arrive whole (as the pipeline holds them) and are cut before the first
layer; only the final gather holds the whole sequence's activations on one rank.
"""
from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.hooks import HookRegistry, ModelHook

from .cfg import CFG_HOOK, cfg_hook
from .context import ParallelContext
from .graphs import GRAPH_HOOK, GraphedForward, check_graphable
from .logs import say_once
from .processors import ShardState
from .sharding import (EMBED_HOOK, GATHER_HOOK, SPLIT_HOOK, SequenceGatherHook, SequenceSplitHook, ShardPlan,
                       VideoWindowEmbedHook, plan_for)
from .vae_decode import decode_over_ranks, is_split, unsplit_vae_decode
from .wave_blocks import WAVES_HOOK, WavesHook, blocks_to_cut

logger = logging.getLogger(__name__)


@dataclass
class _Installed:
    """What `parallelize` changed, so that `unparallelize` can undo exactly that."""

    processors: dict[str, Any]
    hooks: list[tuple[torch.nn.Module, str]]
    state: ShardState


def _transformer(target: Any) -> torch.nn.Module:
    return target.transformer if hasattr(target, "transformer") else target


def parallelize(target: Any, ctx: ParallelContext, vae: bool = True, cuda_graph: bool = False,
                waves: int | str | None = None) -> torch.nn.Module:
    """Run a pipeline's (or a bare) Flux / CogVideoX transformer sequence-parallel over ctx's ranks.

    cuda_graph: capture the whole sharded forward once per input shape and replay it (`graphs.py`; GPU only).
    waves: deprecated (goes in the next release): each block's tokens in this many TokenWeave waves
    (`waves.py`), or "auto". It runs copies of diffusers' block forwards and measured no gain (BENCHMARKS.md:
    Flux 2048 px step on 2 x H200, 469.3 ms with waves=2 vs 463.8 eager); leave it out, and cut a step's fixed
    cost with cuda_graph=True or torch.compile instead.

    Checks the head count against the layout first, so a bad layout fails here, naming the fix, before any
    work. Every rank must call this and then run the same forward calls (same inputs on every rank).
    With `vae` (and a pipeline), the VAE decode is split over the ranks too: patch-parallel, exact
    (`streamfusion_diffusers.vae_parallel`), else diffusers' tiles shared out (`streamfusion_diffusers.vae`):
    every rank must then decode (no output_type="latent" on some ranks only). Returns the transformer.
    """
    if waves is not None:
        warnings.warn("parallelize(waves=...) is deprecated and goes in the next release (it measured no gain); "
                      "leave it out, and use cuda_graph=True or torch.compile for a step's fixed cost",
                      DeprecationWarning, stacklevel=2)
        if waves != "auto" and (not isinstance(waves, int) or waves < 1):
            raise ValueError(f"waves must be a positive integer or 'auto', got {waves!r}")
    transformer = _transformer(target)
    plan = plan_for(transformer)
    if getattr(transformer, "_streamfusion", None) is not None:
        raise ValueError("this transformer is already parallelized; call unparallelize(...) first")
    # method "auto" chooses the layout at the first attention call; cfg "auto" is settled by that call's batch
    if ctx.config.method != "auto" and ctx.config.cfg != "auto":
        ctx.layout(transformer.config.num_attention_heads)
    if cuda_graph:
        check_graphable(ctx)
    original = dict(transformer.attn_processors)
    foreign = sorted({type(p).__name__ for p in original.values() if not isinstance(p, plan.replaces)})
    if foreign:
        raise ValueError(f"the transformer runs attention processors {foreign} that sequence parallelism would "
                         f"replace and lose; unload them (e.g. pipe.unload_ip_adapter()) before parallelize")
    state = ShardState()
    transformer.set_attn_processor(plan.processor(ctx, state))
    hooks: list[tuple[torch.nn.Module, ModelHook, str]] = [
        (transformer, SequenceSplitHook(ctx, state, plan), SPLIT_HOOK),
        (transformer.get_submodule(plan.gather_module), SequenceGatherHook(ctx, state), GATHER_HOOK),
    ]
    if plan.embed_module is not None:
        hooks.append((transformer.get_submodule(plan.embed_module), VideoWindowEmbedHook(state), EMBED_HOOK))
    if waves not in (None, 1):
        hooks += [(block, WavesHook(ctx, state, waves), WAVES_HOOK) for block in blocks_to_cut(transformer)]
    if cuda_graph:  # outer to the token split and gather hooks: they run inside the captured forward
        hooks.append((transformer, GraphedForward(ctx), GRAPH_HOOK))
    if ctx.config.cfg != 1:  # registered last: outermost, it splits the guidance batch before the token split
        hooks.append((transformer, cfg_hook(target, transformer, ctx), CFG_HOOK))
    for module, hook, name in hooks:
        HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, name)
    transformer._streamfusion = _Installed(original, [(m, name) for m, _, name in hooks], state)
    if vae and getattr(target, "vae", None) is not None:  # every rank of the job decodes the same latents
        decode_over_ranks(target.vae, ctx.global_rank, ctx.job_size)
    say_once(logger, logging.INFO, "parallelized %s over %d ranks (%s, cfg=%s)", type(transformer).__name__,
             ctx.job_size, ctx.config.label, ctx.config.cfg)
    return transformer


def unparallelize(target: Any) -> torch.nn.Module:
    """Undo `parallelize`: the original processors back, the hooks removed. Returns the transformer."""
    transformer = _transformer(target)
    installed: _Installed | None = getattr(transformer, "_streamfusion", None)
    if installed is None:
        raise ValueError("this transformer is not parallelized")
    for module, name in reversed(installed.hooks):
        module._diffusers_hook.remove_hook(name, recurse=False)
    transformer.set_attn_processor(dict(installed.processors))
    transformer._streamfusion = None
    if is_split(getattr(target, "vae", None)):
        unsplit_vae_decode(target.vae)
    return transformer


__all__ = ["ShardPlan", "parallelize", "plan_for", "unparallelize"]
