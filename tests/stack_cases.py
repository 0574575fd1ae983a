"""The per-rank workers of tests/test_stack_p4.py: a tiny Flux pipeline with a cache, LoRAs or int8 weights
stacked on it, run on every rank through `parallelize` and on one rank without it, from the same seed.

Every rank builds the same seeded pipeline; the one-rank reference is computed on each rank, without any
collective, and compared with the parallel latents (gathered whole on every rank) by relative_error.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from diffusers.hooks import FirstBlockCacheConfig, TaylorSeerCacheConfig
from diffusers.hooks._helpers import TransformerBlockRegistry
from diffusers.hooks.first_block_cache import FBCHeadBlockHook, FBCSharedBlockState
from diffusers.hooks.hooks import CacheContext, StateManager
from torch import Tensor

from streamfusion_diffusers import ParallelConfig, parallelize, unparallelize
from streamfusion_diffusers.core.exactness import relative_error
from streamfusion_diffusers.diffusers.stack.apply import apply_stack
from streamfusion_diffusers.diffusers.stack.spec import Stack
from streamfusion_diffusers.models.build import build_pipeline

from model_cases import context

CONFIG = ParallelConfig(machines=2, gpus_per_machine=2, method="torus", ulysses=2, ring=2)
MODEL, PROMPT, SIZE = "tiny-flux", "a red cat", 64


def latents(pipe: Any, steps: int) -> Tensor:
    with torch.inference_mode():
        return pipe(PROMPT, height=SIZE, width=SIZE, num_inference_steps=steps, output_type="latent",
                    generator=torch.Generator().manual_seed(0)).images


def make_lora(folder: Path, seed: int) -> str:
    """A random LoRA on the attention projections of the tiny Flux transformer, saved by the pipeline's
    save_lora_weights (the folder holds pytorch_lora_weights.safetensors)."""
    from diffusers import FluxPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    transformer = build_pipeline(MODEL).transformer
    torch.manual_seed(seed)
    transformer.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False,
                                       target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_mlp"]))
    FluxPipeline.save_lora_weights(str(folder), transformer_lora_layers=get_peft_model_state_dict(transformer))
    return str(folder)


def enable(config: Any) -> Callable[[Any, Any], None]:
    """A cache enabled as diffusers users do, before parallelize."""
    def stack(pipe: Any, ctx: Any) -> None:
        pipe.transformer.enable_cache(config)
        if ctx is not None:
            parallelize(pipe, ctx, vae=False)
    return stack


def lora_after(folder: str, scale: float) -> Callable[[Any, Any], None]:
    """A LoRA loaded after parallelize (peft layers, not fused), weighted by set_adapters."""
    def stack(pipe: Any, ctx: Any) -> None:
        if ctx is not None:
            parallelize(pipe, ctx, vae=False)
        pipe.load_lora_weights(folder, adapter_name="mine")
        pipe.set_adapters(["mine"], adapter_weights=[scale])
    return stack


def int8_after(pipe: Any, ctx: Any) -> None:
    """torchao int8 weight-only on the transformer's Linears of a parallelized pipeline."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    if ctx is not None:
        parallelize(pipe, ctx, vae=False)
    quantize_(pipe.transformer, Int8WeightOnlyConfig())


def command_line(stack_spec: Stack) -> Callable[[Any, Any], None]:
    """What `generate` does: apply_stack, then parallelize."""
    def stack(pipe: Any, ctx: Any) -> None:
        apply_stack(pipe, stack_spec)
        if ctx is not None:
            parallelize(pipe, ctx, vae=False)
    return stack


STACKS: dict[str, Callable[..., Callable[[Any, Any], None]]] = {
    "first-block": lambda: enable(FirstBlockCacheConfig(threshold=10.0)),  # every call after the first skips
    "taylorseer": lambda: enable(TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1,
                                                       taylor_factors_dtype=torch.float32)),
    "lora-after-parallelize": lora_after,
    "int8-after-parallelize": lambda: int8_after,
    "command-line": command_line,
}


def stacked(name: str, args: tuple, parallel: bool, steps: int) -> Tensor:
    pipe = build_pipeline(MODEL)
    STACKS[name](*args)(pipe, context(CONFIG) if parallel else None)
    out = latents(pipe, steps)
    if parallel:
        unparallelize(pipe)
    return out


def compare(name: str, args: tuple, steps: int) -> dict[str, float]:
    """On every rank: the stack on every rank against the same stack on one rank (error), and the one-rank
    stack against the plain pipeline (effect: the stack changed something)."""
    one = stacked(name, args, False, steps)
    return {"error": relative_error(stacked(name, args, True, steps), one),
            "effect": relative_error(one, latents(build_pipeline(MODEL), steps))}


def straddle() -> dict[str, Any]:
    """On every rank: a First Block Cache threshold between the ranks' local metrics.

    A plain run records the first block's residual of the two calls on this rank's tokens; each rank's local
    metric (diffusers' own decision code on its slice) and the metric over all tokens give a threshold that the
    local metrics straddle while the whole one is below it. With that threshold diffusers' decision per slice
    differs across ranks; the agreed one skips on every rank, and the output equals one rank's."""
    ctx = context(CONFIG)
    pipe = build_pipeline(MODEL)
    parallelize(pipe, ctx, vae=False)
    block = pipe.transformer.transformer_blocks[0]
    meta = TransformerBlockRegistry.get(type(block))
    residuals: list[Tensor] = []
    block.register_forward_hook(lambda _m, _a, kw, out: residuals.append(
        out[meta.return_hidden_states_index] - kw["hidden_states"]), with_kwargs=True)
    latents(pipe, 2)
    unparallelize(pipe)
    first, second = residuals
    change, base = (second - first).abs().sum().double(), first.abs().sum().double()
    local = (change / base).item()
    sums = torch.stack([change, base])
    dist.all_reduce(sums)
    whole = (sums[0] / sums[1]).item()
    metrics = [None] * dist.get_world_size()
    dist.all_gather_object(metrics, local)
    threshold = (whole + max(metrics)) / 2

    def diffusers_decides() -> bool:  # diffusers' unagreed decision on this rank's slice
        hook = FBCHeadBlockHook(StateManager(FBCSharedBlockState), threshold)
        hook.state_manager.set_context(CacheContext("cond"))
        hook.state_manager.get_state().head_block_residual = first
        return hook._should_compute_remaining_blocks(second)

    def run(parallel: bool) -> tuple[Tensor, int]:
        pipe = build_pipeline(MODEL)
        pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=threshold))
        tail_calls: list[int] = []  # the last block's attention runs only when the call is not skipped
        pipe.transformer.single_transformer_blocks[-1].attn.register_forward_hook(
            lambda *_: tail_calls.append(1))
        if parallel:
            parallelize(pipe, ctx, vae=False)
        out = latents(pipe, 2)
        if parallel:
            unparallelize(pipe)
        return out, len(tail_calls)

    (many, many_calls), (one, one_calls) = run(True), run(False)
    return {"metrics": metrics, "whole": whole, "threshold": threshold, "diffusers_computes": diffusers_decides(),
            "calls": many_calls, "one_rank_calls": one_calls, "error": relative_error(many, one)}
