"""`parallelize` / `unparallelize`: sequence parallelism around any diffusers pipeline or transformer with a plan.

The model's context-parallel plan (`plans/`: diffusers' `_cp_plan`, or ours) decides what is split and gathered
(`sharding.py` applies it by hooks); `routing.py` sends each self-attention over the split sequence to
`sp_attention` and leaves attention to unsplit tokens (cross-attention to the text) local. As asked, the CFG
split (`cfg.py`), a CUDA graph of the whole forward (`graphs.py`), the weights sharded
(`sharded_weights.py`) and the VAE decode over the ranks (`vae/`) go on too. The inputs arrive whole (as the
pipeline holds them) and are cut where the plan says; only the final gather holds the whole sequence on one rank.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..context import ParallelContext
from ..core.logs import say_once
from .cfg import CFG_HOOK, cfg_hook, check_cfg
from .graphs import GRAPH_HOOK, GraphedForward, check_graphable
from .plans import ModelPlan, plan_for
from .overlap_mlp import overlap_mlp_hooks
from .routing import route_attention, set_processors
from .sharded_weights import CANNOT_UNDO, is_sharded, shard_pipeline
from .sharding import FORWARD_HOOK, ForwardHook, PlanState, install, plan_hooks
from .stack.skips import release_skips
from .targets import transformers_of
from .vae import decode_over_ranks, is_split, unsplit_vae_decode
from .weight_split import Split

logger = logging.getLogger(__name__)


@dataclass
class _Installed:
    """What `parallelize` changed, so that `unparallelize` can undo exactly that."""

    processors: dict[str, Any]
    hooks: list[tuple[torch.nn.Module, str]]
    state: PlanState
    vae_decode: str | None = None  # how the pipeline's VAE decodes: patch-parallel, tiles, one-rank (None: untouched)
    sharded: tuple[str, ...] = ()  # the components whose weights are sharded (shard_weights=True)
    split: Split | None = None  # how many blocks of each stay gathered, and the bytes a rank holds


def parallelize(target: Any, ctx: ParallelContext, vae: bool = True, cuda_graph: bool = False,
                shard_weights: bool = False, weight_budget: int | None = None, streamed: str = "gather"
                ) -> torch.nn.Module:
    """Run a pipeline's (or a bare) transformer sequence-parallel over ctx's ranks, as its plan splits it.

    cuda_graph: capture the whole sharded forward once per input shape and replay it (`graphs.py`; GPU only).
    shard_weights: every rank keeps only its share of the weights (`sharded_weights.py`: the transformers' blocks
    and, for a pipeline, its text encoders' layers, over the job's ranks), as far as `weight_budget` (bytes of
    weights per rank; None: every block) needs; a sharded block is gathered in place just before it runs, the
    others are gathered once. Plain or quantized (torchao) weights, eager, compiled or in a CUDA graph; the same
    output; `unparallelize` cannot undo it (it refuses). streamed="tensor": the streamed blocks of a model with a
    diffusers tensor-parallel plan (Flux, Flux.2) keep their share of its cut projections and run tensor-parallel,
    their tokens gathered instead of their weights (`tensor_blocks.py`: fewer bytes per step at image sizes).

    Checks the head count against the layout first, so a bad layout fails here, naming the fix, before any
    work. Every rank must call this and then run the same forward calls (same inputs on every rank).
    With `vae` (and a pipeline), the VAE decode is split over the ranks too: patch-parallel, exact
    (`streamfusion_diffusers.diffusers.vae.bands`), else diffusers' tiles shared out (`streamfusion_diffusers.diffusers.vae.tiles`),
    else (VAEs of neither kind) on one rank, broadcast; `transformer._streamfusion.vae_decode` says which. It is
    shared over `ctx.pipeline_group`: the job, or with worlds given, this rank's world (each world decodes its own
    latents). Every rank must then decode (no output_type="latent" on some ranks only). A pipeline with two
    transformers (Wan 2.2 A14B's experts) gets both parallelized. Returns the (first) transformer.
    """
    transformers = transformers_of(target)
    plans = [plan_for(t) for t in transformers]  # a model without a plan is refused here, naming it
    if any(getattr(t, "_streamfusion", None) is not None for t in transformers):
        raise ValueError("this transformer is already parallelized; call unparallelize(...) first")
    if streamed not in ("gather", "tensor"):
        raise ValueError(f"streamed={streamed!r}: pass 'gather' (weights gathered before each streamed block) or "
                         f"'tensor' (streamed blocks run tensor-parallel)")
    if shard_weights and any(is_sharded(t) for t in transformers):
        raise ValueError("the transformer is already sharded: pass it unsharded to parallelize")
    # method "auto" chooses the layout at the first attention call; cfg "auto" is settled by that call's batch
    if ctx.config.method != "auto" and ctx.config.cfg != "auto":
        ctx.layout(transformers[0].config.get("num_attention_heads"))
    if cuda_graph:
        check_graphable(ctx)
    if ctx.config.cfg != 1:
        for transformer, plan in zip(transformers, plans):
            check_cfg(transformer, plan)
    for transformer, plan in zip(transformers, plans):
        transformer._streamfusion = _install(target, transformer, plan, ctx, cuda_graph)
    transformer = transformers[0]
    if shard_weights:  # after the hooks: a refusal above leaves nothing sharded
        sharded, transformer._streamfusion.split = shard_pipeline(target, transformers, ctx, weight_budget,
                                                                   streamed)
        transformer._streamfusion.sharded = tuple(sharded)
    if vae and getattr(target, "vae", None) is not None:  # over the ranks that hold the same latents
        group = ctx.pipeline_group
        transformer._streamfusion.vae_decode = decode_over_ranks(target.vae, group.index, group.size, group.pg)
    say_once(logger, logging.INFO, "parallelized %s over %d ranks (%s, cfg=%s, plan: %s)",
             type(transformer).__name__, ctx.job_size, ctx.config.label, ctx.config.cfg,
             plans[0].source)
    return transformer


def _install(target: Any, transformer: torch.nn.Module, plan: ModelPlan, ctx: ParallelContext, cuda_graph: bool
             ) -> _Installed:
    """One transformer's hooks and attention routing, as its plan says."""
    state = PlanState()
    hooks = plan_hooks(transformer, plan, ctx, state)  # innermost first
    if ctx.config.overlap_mlp:  # on blocks nothing else hooks: inner to every hook on the transformer
        hooks = overlap_mlp_hooks(transformer) + hooks
    original = route_attention(transformer, plan, ctx, state)  # the last check that can refuse: nothing before
    if cuda_graph:  # outer to the token split and gather hooks: they run inside the captured forward
        graphed = GraphedForward(ctx)
        ctx.on_close(graphed.release)  # NCCL's teardown waits for the graphs that captured its calls
        hooks.append((transformer, graphed, GRAPH_HOOK))
    forward = ForwardHook(ctx, state, plan.key_masks, plan.drop_full_masks, plan.text_whole,  # masks read eagerly
                          plan.text_rows, plan.text_input)
    hooks.append((transformer, forward, FORWARD_HOOK))
    if ctx.config.cfg != 1:  # registered last: outermost, it splits the guidance batch before the token split
        hooks.append((transformer, cfg_hook(target, ctx), CFG_HOOK))
    install(hooks)
    return _Installed(original, [(m, name) for m, _, name in hooks], state)


def unparallelize(target: Any) -> torch.nn.Module:
    """Undo `parallelize`: the original processors back, the hooks removed. Returns the transformer. Refuses (and
    changes nothing) where the weights were sharded: each rank holds only its shards."""
    transformers = transformers_of(target)
    if getattr(transformers[0], "_streamfusion", None) is None:
        raise ValueError("this transformer is not parallelized")
    if transformers[0]._streamfusion.sharded:
        raise ValueError(CANNOT_UNDO)
    for transformer in reversed(transformers):  # the reverse of parallelize: a scheduler's step comes back whole
        installed: _Installed = transformer._streamfusion
        for module, name in reversed(installed.hooks):
            module._diffusers_hook.remove_hook(name, recurse=False)
        set_processors(transformer, installed.processors)
        release_skips(transformer)
        transformer._streamfusion = None
    if is_split(getattr(target, "vae", None)):
        unsplit_vae_decode(target.vae)
    return transformers[0]


__all__ = ["parallelize", "unparallelize"]
