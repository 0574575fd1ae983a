"""`parallelize` / `unparallelize`: sequence parallelism around a diffusers Flux or CogVideoX transformer.

`parallelize` installs the sequence-parallel processors and three kinds of diffusers hooks:
a split hook on the transformer (image/video tokens cut by rank, with their rotary embeddings or position ids;
text tokens cut the same way when their count divides P, else kept whole as joint tokens), for CogVideoX a
patch-embedding hook that embeds only this rank's video tokens, and a gather hook on `proj_out` that puts the
output sequence back together. The inputs arrive whole (as the pipeline holds them) and are cut before the
first layer; only the final gather holds the whole sequence's activations on one rank.
"""
from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import CogVideoXTransformer3DModel, FluxTransformer2DModel
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from diffusers.models.attention_processor import CogVideoXAttnProcessor2_0, FusedCogVideoXAttnProcessor2_0
from diffusers.models.embeddings import CogVideoXPatchEmbed
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
from torch import Tensor

from .cfg import CFG_HOOK, cfg_hook
from .context import ParallelContext
from .graphs import GRAPH_HOOK, GraphedForward, check_graphable
from .logs import say_once
from .processors import CogVideoXSPAttnProcessor, FluxSPAttnProcessor, ShardState, TokenLayout
from .sequence import gather, split_sizes
from .vae import is_split, unsplit_vae_decode
from .vae_parallel import decode_over_ranks
from .wave_blocks import WAVES_HOOK, WavesHook, blocks_to_cut

logger = logging.getLogger(__name__)

SPLIT_HOOK, GATHER_HOOK, EMBED_HOOK = "streamfusion_split", "streamfusion_gather", "streamfusion_embed"
TEXT_INPUTS = frozenset({"encoder_hidden_states", "txt_ids"})


@dataclass(frozen=True)
class ShardPlan:
    """Which forward arguments carry image or text tokens (and along which dim, as diffusers' `_cp_plan` says),
    how many image tokens a call has, which submodule's output is gathered, and which processor to install."""

    image_inputs: dict[str, ContextParallelInput]
    text_inputs: dict[str, ContextParallelInput]
    image_tokens: Callable[[torch.nn.Module, dict[str, Any]], int]
    gather_module: str
    processor: type
    replaces: tuple[type, ...]  # the stock processors ours stand in for; any other (IP-Adapter, ...) is refused
    embed_module: str | None = None


def _flux_image_tokens(_: torch.nn.Module, arguments: dict[str, Any]) -> int:
    return arguments["hidden_states"].shape[1]


def _cogvideox_image_tokens(module: torch.nn.Module, arguments: dict[str, Any]) -> int:
    _, frames, _, height, width = arguments["hidden_states"].shape
    p, p_t = module.config.patch_size, module.config.patch_size_t
    return (frames // (p_t or 1)) * (height // p) * (width // p)


def _plan_from_cp_plan(cp_plan: dict[str, Any]) -> tuple[dict[str, ContextParallelInput],
                                                        dict[str, ContextParallelInput], str]:
    """Read diffusers' `_cp_plan`: the split arguments of the top-level forward and the gathered submodule."""
    inputs = {name: spec for name, spec in cp_plan[""].items()
              if isinstance(spec, ContextParallelInput) and not spec.split_output}
    gathers = [name for name, spec in cp_plan.items() if isinstance(spec, ContextParallelOutput)]
    if len(gathers) != 1:
        raise ValueError(f"expected one gathered output in the context-parallel plan, got {gathers}")
    image = {k: v for k, v in inputs.items() if k not in TEXT_INPUTS}
    text = {k: v for k, v in inputs.items() if k in TEXT_INPUTS}
    return image, text, gathers[0]


def plan_for(transformer: torch.nn.Module) -> ShardPlan:
    """The sharding plan of a supported transformer; Flux's comes from its own `_cp_plan`."""
    if isinstance(transformer, FluxTransformer2DModel):
        image, text, gather_module = _plan_from_cp_plan(type(transformer)._cp_plan)
        return ShardPlan(image, text, _flux_image_tokens, gather_module, FluxSPAttnProcessor, (FluxAttnProcessor,))
    if isinstance(transformer, CogVideoXTransformer3DModel):
        # diffusers 0.42 has no _cp_plan for CogVideoX: the latent video is cut at the patch embedding instead
        return ShardPlan({"image_rotary_emb": ContextParallelInput(split_dim=0, expected_dims=2)},
                         {"encoder_hidden_states": ContextParallelInput(split_dim=1, expected_dims=3)},
                         _cogvideox_image_tokens, "proj_out", CogVideoXSPAttnProcessor,
                         (CogVideoXAttnProcessor2_0, FusedCogVideoXAttnProcessor2_0), embed_module="patch_embed")
    raise ValueError(f"{type(transformer).__name__} is not supported; parallelize takes a FluxTransformer2DModel, "
                     f"a CogVideoXTransformer3DModel, or a pipeline whose .transformer is one")


def _slice(name: str, value: Any, spec: ContextParallelInput, start: int, stop: int) -> Any:
    """value[start:stop] along the spec's dim; tuples (cos, sin) element by element."""
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        return type(value)(_slice(name, v, spec, start, stop) for v in value)
    if spec.expected_dims is not None and value.dim() != spec.expected_dims:
        raise ValueError(f"{name} has {value.dim()} dims, expected {spec.expected_dims}: pass it as diffusers' "
                         f"pipelines do (e.g. txt_ids / img_ids as 2-D [L, 3] tensors)")
    return value.narrow(spec.split_dim, start, stop - start)


class SequenceSplitHook(ModelHook):
    """Before each forward: work out the token layout, publish it to the processors, and cut the inputs."""

    def __init__(self, ctx: ParallelContext, state: ShardState, plan: ShardPlan):
        super().__init__()
        self.ctx, self.state, self.plan = ctx, state, plan
        self.signature: inspect.Signature | None = None

    def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        self.signature = inspect.signature(module.forward)
        return module

    def layout(self, module: torch.nn.Module, arguments: dict[str, Any]) -> TokenLayout:
        world = self.ctx.world_size
        image = self.plan.image_tokens(module, arguments)
        if image < world:
            raise ValueError(f"{image} image/video tokens cannot be split over {world} ranks; raise the resolution "
                             f"(or the frame count) to at least {world} tokens, or run on fewer ranks")
        text = arguments["encoder_hidden_states"].shape[1]
        return TokenLayout(rank=self.ctx.rank, text_total=text, text_sharded=text % world == 0,
                           image_lens=tuple(split_sizes(image, world)))

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        bound = self.signature.bind(*args, **kwargs)
        arguments = bound.arguments
        layout = self.state.layout = self.layout(module, arguments)
        for name, spec in self.plan.image_inputs.items():
            if name in arguments:
                arguments[name] = _slice(name, arguments[name], spec, *layout.image_range)
        if layout.text_sharded:
            for name, spec in self.plan.text_inputs.items():
                if name in arguments:
                    arguments[name] = _slice(name, arguments[name], spec, *layout.text_range)
        return bound.args, bound.kwargs

    def post_forward(self, module: torch.nn.Module, output: Any) -> Any:
        self.state.layout = None
        return output


class SequenceGatherHook(ModelHook):
    """After the output projection: all-gather the image/video token slices into the full sequence."""

    def __init__(self, ctx: ParallelContext, state: ShardState):
        super().__init__()
        self.ctx, self.state = ctx, state

    def post_forward(self, module: torch.nn.Module, output: Tensor) -> Tensor:
        # the SP group: the whole job, or with CFG parallelism this rank's guidance branch
        return gather(output, list(self.state.layout.image_lens), self.ctx.cfg.sp.pg, dim=1)


class VideoWindowEmbedHook(ModelHook):
    """CogVideoX's patch embedding for this rank's video tokens only (the stock one embeds the whole video).

    Only the latent frames that hold this rank's tokens go through the projection; the sin-cos positional
    embedding (CogVideoX 2b), if any, is sliced to the same tokens.
    """

    def __init__(self, state: ShardState):
        super().__init__()
        self.state = state

    def new_forward(self, module: CogVideoXPatchEmbed, text_embeds: Tensor, image_embeds: Tensor) -> Tensor:
        layout = self.state.layout
        start, stop = layout.image_range
        text = module.text_proj(text_embeds)
        video = _embed_video_window(module, image_embeds, start, stop)
        embeds = torch.cat([text, video], dim=1).contiguous()
        if module.use_positional_embeddings or module.use_learned_positional_embeddings:
            pos = _positional_embedding(module, image_embeds, layout.text_total)
            t0, t1 = layout.text_range
            text_total = layout.text_total
            pos = torch.cat([pos[:, t0:t1], pos[:, text_total + start:text_total + stop]], dim=1)
            embeds = embeds + pos.to(dtype=embeds.dtype)
        return embeds


def _embed_video_window(module: CogVideoXPatchEmbed, latents: Tensor, start: int, stop: int) -> Tensor:
    """Tokens [start, stop) of CogVideoXPatchEmbed's video embedding, projecting only the frames they lie in."""
    batch, _, channels, height, width = latents.shape
    p, p_t = module.patch_size, module.patch_size_t
    per_step = (height // p) * (width // p)  # tokens per latent frame (per group of p_t frames in CogVideoX 1.5)
    first, last = start // per_step, -(-stop // per_step)
    steps = last - first
    group = p_t or 1
    window = latents[:, first * group:last * group]
    if p_t is None:
        x = module.proj(window.reshape(-1, channels, height, width))
        x = x.view(batch, steps, *x.shape[1:]).flatten(3).transpose(2, 3).flatten(1, 2)
    else:
        x = window.permute(0, 1, 3, 4, 2).reshape(batch, steps, p_t, height // p, p, width // p, p, channels)
        x = module.proj(x.permute(0, 1, 3, 5, 7, 2, 4, 6).flatten(4, 7).flatten(1, 3))
    offset = first * per_step
    return x[:, start - offset:stop - offset]


def _positional_embedding(module: CogVideoXPatchEmbed, latents: Tensor, text_total: int) -> Tensor:
    """The stock patch embedding's [1, text + video, D] positional table, with its checks."""
    _, frames, _, height, width = latents.shape
    if module.use_learned_positional_embeddings and (module.sample_width != width
                                                     or module.sample_height != height):
        raise ValueError("learned positional embeddings only work at the model's sample resolution "
                         f"{module.sample_height}x{module.sample_width} (latent); generate at that size")
    if text_total != module.max_text_seq_length:
        raise ValueError(f"this CogVideoX adds positional embeddings for exactly {module.max_text_seq_length} text "
                         f"tokens, got {text_total}; pad the prompt to max_sequence_length="
                         f"{module.max_text_seq_length}")
    pixel_frames = (frames - 1) * module.temporal_compression_ratio + 1
    if (module.sample_height, module.sample_width, module.sample_frames) != (height, width, pixel_frames):
        return module._get_positional_embeddings(height, width, pixel_frames, device=latents.device)
    return module.pos_embedding


@dataclass
class _Installed:
    """What `parallelize` changed, so that `unparallelize` can undo exactly that."""

    processors: dict[str, Any]
    hooks: list[tuple[torch.nn.Module, str]]
    state: ShardState


def _transformer(target: Any) -> torch.nn.Module:
    return target.transformer if hasattr(target, "transformer") else target


def parallelize(target: Any, ctx: ParallelContext, vae: bool = True, cuda_graph: bool = False,
                waves: int | str = 1) -> torch.nn.Module:
    """Run a pipeline's (or a bare) Flux / CogVideoX transformer sequence-parallel over ctx's ranks.

    cuda_graph: capture the whole sharded forward once per input shape and replay it (`graphs.py`; GPU only).
    waves: run each block's tokens in this many waves so one wave's transfers overlap the other's compute
    (`waves.py`), or "auto" (2 where the per-GPU share fills the GPU's SMs twice over, else 1).

    Checks the head count against the layout first, so a bad layout fails here, naming the fix, before any
    work. Every rank must call this and then run the same forward calls (same inputs on every rank).
    With `vae` (and a pipeline), the VAE decode is split over the ranks too: patch-parallel, exact
    (`streamfusion_diffusers.vae_parallel`), else diffusers' tiles shared out (`streamfusion_diffusers.vae`):
    every rank must then decode (no output_type="latent" on some ranks only). Returns the transformer.
    """
    transformer = _transformer(target)
    plan = plan_for(transformer)
    if getattr(transformer, "_streamfusion", None) is not None:
        raise ValueError("this transformer is already parallelized; call unparallelize(...) first")
    # method "auto" chooses the layout at the first attention call; cfg "auto" is settled by that call's batch
    if ctx.config.method != "auto" and ctx.config.cfg != "auto":
        ctx.layout(transformer.config.num_attention_heads)
    if cuda_graph:
        check_graphable(ctx)
    if waves != "auto" and (not isinstance(waves, int) or waves < 1):
        raise ValueError(f"waves must be a positive integer or 'auto', got {waves!r}")
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
    if waves != 1:
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
