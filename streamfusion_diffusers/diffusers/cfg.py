"""Classifier-free-guidance parallelism: the two guidance branches of a step computed at once, each by its own half
of the ranks.

`CfgSplitHook`, the outermost hook `parallelize` puts on the transformer when cfg > 1, hands each branch its part
of the guidance (the SP split hook inside it then cuts that part's tokens over the branch's SP group) and
all-gathers the noise predictions across the branches, so the pipeline's guidance math sees what it always did.
The branches exchange one noise prediction per step; their attention traffic stays inside each branch, which
`config.cfg_shape` places on its own machines when it can.
"""
from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
import torch.distributed as dist
from diffusers import FluxPipeline, QwenImagePipeline, WanPipeline
from diffusers.hooks import ModelHook
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from torch import Tensor

from ..context import ParallelContext
from ..core.sequence import gather
from .plans import ModelPlan

logger = logging.getLogger(__name__)

CFG_HOOK = "streamfusion_cfg"
# forward arguments that carry the guidance batch on dim 0 (Flux, CogVideoX; then LTX-2's audio stream, masks,
# coordinates and per-stream timesteps); ids and rotary tables without a batch dim are shared by the branches
BATCHED = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance", "ofs",
           "audio_hidden_states", "audio_encoder_hidden_states", "audio_timestep", "sigma", "audio_sigma",
           "encoder_attention_mask", "audio_encoder_attention_mask", "video_coords", "audio_coords",
           "perturbation_mask", "video_self_attention_mask", "video_keyframes_mask")
# pipelines whose guidance is two transformer calls per step, neither output read before the second call nor
# touched before the scheduler step (read in their source): their calls can be paired. A pipeline that casts
# or slices the output in between (CogVideoX's `.float()`) must not defer it.
PAIRED = (FluxPipeline, QwenImagePipeline, WanPipeline)


class CfgSplitHook(ModelHook):
    """Runs this branch's part of each guidance batch and all-gathers the branches' outputs.

    One call with the batch [uncond ; cond] (CogVideoX, LTX-2): branch b computes the b-th half of every batched
    input, and every output (LTX-2's video and audio) is gathered. Two calls of batch 1 per step (Flux and
    Qwen-Image with true_cfg_scale > 1, Wan with guidance_scale > 1; after `pair_calls`):
    the first call is deferred and returns an empty tensor, the second runs the first call's inputs on branch 0
    and its own on branch 1 at once, fills the first call's tensor in place (resized to the output's shape, so
    any transformer's output fits) and returns its own. The pipeline reads neither before the second call; a
    step with only one call (guidance off) is flushed before the scheduler step reads it. A deferred call pairs
    only with a call of its own timestep: one left over by an error (the pipeline raised between the two calls)
    is dropped, not paired with the next generation's first call, and its tensor stays empty, never stale.
    """

    def __init__(self, ctx: ParallelContext):
        super().__init__()
        self.ctx = ctx
        self.signature: inspect.Signature | None = None
        self.pending: tuple[inspect.BoundArguments, Tensor] | None = None
        self.scheduler: Any = None
        self.previous_step: Any = None  # the scheduler's own step attribute before ours (another hook's), if any
        self.warned = False

    def initialize_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        self.signature = inspect.signature(module.forward)
        return module

    def deinitalize_hook(self, module: torch.nn.Module) -> torch.nn.Module:  # diffusers' spelling
        if self.scheduler is not None:  # undone in reverse order of pairing: the step before ours comes back
            if self.previous_step is None:
                del self.scheduler.step  # the instance attribute set by pair_calls; the class method shows again
            else:
                self.scheduler.step = self.previous_step
            self.scheduler = None
        return module

    def pair_calls(self, scheduler: Any) -> None:
        """Pair a pipeline's two guidance calls per step; a pending call is flushed before each scheduler step.
        Several transformers of one pipeline (Wan 2.2 A14B's experts) each pair their own calls."""
        step, self.previous_step = scheduler.step, scheduler.__dict__.get("step")

        def flushed_step(*args: Any, **kwargs: Any) -> Any:
            self.flush()
            return step(*args, **kwargs)

        scheduler.step, self.scheduler = flushed_step, scheduler

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        bound = self.signature.bind(*args, **kwargs)
        batch = bound.arguments["hidden_states"].shape[0]
        degree = self.ctx.resolve_cfg(batch)
        if degree == 1:
            return self.fn_ref.original_forward(*args, **kwargs)
        if batch % degree == 0:
            out = self._forward(self._branch(bound, batch, degree))
            return _gathered(out, [batch // degree] * degree, self.ctx.cfg.cfg.pg)
        if self.pending is not None and not _same_step(self.pending[0], bound):
            logger.warning("cfg: a deferred transformer call was never paired (an error between the guidance "
                           "calls?); it is dropped")
            self.pending = None
        if self.scheduler is not None and self.pending is None:
            weight = module.proj_out.weight
            placeholder = torch.empty(0, dtype=weight.dtype, device=weight.device)
            self.pending = bound, placeholder
            return _output(bound, placeholder)
        if self.pending is not None:
            first, placeholder = self.pending
            self.pending = None
            out = self._forward(first if self.ctx.cfg.cfg.index == 0 else bound)
            both = gather(_sample(out), [batch] * degree, self.ctx.cfg.cfg.pg, dim=0)
            placeholder.resize_(both[:batch].shape).copy_(both[:batch])
            return _with_sample(out, both[batch:])
        self._warn_unguided(batch)
        return self.fn_ref.original_forward(*args, **kwargs)

    def flush(self) -> None:
        """Compute a deferred call whose pair never came (every branch the same inputs) into its tensor."""
        if self.pending is None:
            return
        first, placeholder = self.pending
        self.pending = None
        sample = _sample(self._forward(first))
        self._warn_unguided(sample.shape[0])
        placeholder.resize_(sample.shape).copy_(sample)

    def _forward(self, bound: inspect.BoundArguments) -> Any:
        return self.fn_ref.original_forward(*bound.args, **bound.kwargs)

    def _branch(self, bound: inspect.BoundArguments, batch: int, degree: int) -> inspect.BoundArguments:
        per, branch = batch // degree, self.ctx.cfg.cfg.index
        for name in BATCHED:
            value = bound.arguments.get(name)
            if isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == batch:
                bound.arguments[name] = value[branch * per:(branch + 1) * per]
        return bound

    def _warn_unguided(self, batch: int) -> None:
        if not self.warned and self.ctx.global_rank == 0:
            logger.warning("cfg=%d but the transformer got batch %d in one call per step (guidance off?): every "
                           "branch computes it whole; use cfg=1 (or 'auto') for unguided runs",
                           self.ctx.cfg.degree, batch)
        self.warned = True


def check_cfg(transformer: torch.nn.Module, plan: ModelPlan) -> None:
    """Refuse, before parallelize changes anything, a transformer whose forward takes no `hidden_states` batch to
    split over the guidance branches (Z-Image's per-row lists, Cosmos3's packed sequence of one prompt), or whose
    plan says it takes no guidance batch (MiniMax-H3)."""
    if "hidden_states" not in inspect.signature(transformer.forward).parameters or not plan.guidance_batch:
        raise ValueError(f"cfg parallelism splits the guidance batch of hidden_states, which "
                         f"{type(transformer).__name__}'s forward does not take: pass cfg=1")


def cfg_hook(target: Any, ctx: ParallelContext) -> CfgSplitHook:
    """The CFG hook for `parallelize(target, ctx)`; for a pipeline of PAIRED, pairing its two guidance calls per
    step (others, such as CogVideoX's one call of batch 2, are split as they come)."""
    hook = CfgSplitHook(ctx)
    if isinstance(target, PAIRED):
        hook.pair_calls(target.scheduler)
    return hook


def _same_step(first: inspect.BoundArguments, bound: inspect.BoundArguments) -> bool:
    """Whether two calls are the two guidance calls of one step: the same timestep and latent shape."""
    a, b = first.arguments, bound.arguments
    t, u = a.get("timestep"), b.get("timestep")
    same_t = t is u or (isinstance(t, Tensor) and isinstance(u, Tensor) and t.shape == u.shape and torch.equal(t, u))
    return same_t and a["hidden_states"].shape == b["hidden_states"].shape


def _sample(output: Any) -> Tensor:
    return output[0] if isinstance(output, tuple) else output.sample


def _with_sample(output: Any, sample: Tensor) -> Any:
    if isinstance(output, tuple):
        return (sample, *output[1:])
    output.sample = sample
    return output


def _gathered(output: Any, sizes: list[int], pg: dist.ProcessGroup) -> Any:
    """The output with every tensor in it (LTX-2's video and audio) all-gathered over the branches on dim 0."""
    if isinstance(output, tuple):
        return tuple(gather(x, sizes, pg, dim=0) if isinstance(x, Tensor) else x for x in output)
    for name, value in output.items():
        if isinstance(value, Tensor):
            output[name] = gather(value, sizes, pg, dim=0)
    return output


def _output(bound: inspect.BoundArguments, sample: Tensor) -> Any:
    """The transformer's output for `sample`, as its return_dict argument asks."""
    return Transformer2DModelOutput(sample=sample) if bound.arguments.get("return_dict", True) else (sample,)


__all__ = ["CFG_HOOK", "CfgSplitHook", "cfg_hook", "check_cfg"]
