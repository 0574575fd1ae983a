"""xDiT (xfuser 0.7.0) users switch to our attention with one call or one flag.

    pipe = xFuserFluxPipeline.from_pretrained(model, engine_config=engine_config, torch_dtype=torch.bfloat16)
    streamfusion_diffusers.xdit.enable(pipe, method="torus", machines=2)   # every rank, after building the pipe
    ...                                                                     # pipe(...) as before
    streamfusion_diffusers.xdit.disable(pipe)                              # xfuser's USP again

or, for xfuser's own scripts: `python -m streamfusion_diffusers.xdit script.py --sf-method torus <xfuser args>`.

xfuser keeps everything but the attention: its CFG and data parallelism, its token sharding, its VAE. Our
ParallelContext spans each of xfuser's sequence-parallel groups (one per CFG branch and replica), with xfuser's
Ulysses x Ring degrees unless `ulysses=` / `ring=` say otherwise, placed on the machines the group spans.
xfuser is imported here only, lazily: it refuses to import without a GPU.
"""
from __future__ import annotations

import importlib.util
import logging
import os
from typing import Any

import torch.distributed as dist

from .. import init_parallel
from ..context import ParallelContext
from ..core.extras import missing
from .install import install, model_name, uninstall
from .layout import XDiTJob, parallel_config, refuse_unsupported

__all__ = ["disable", "enable"]

logger = logging.getLogger(__name__)
CONTEXTS = "_streamfusion_contexts"  # the pipeline's contexts, one per layout and worlds: enable/disable cycles
# of one pipeline reuse them (and their process groups); they go with the pipeline


def read_job(pipe: Any) -> XDiTJob:
    """xfuser's parallel set-up of a built pipeline: its engine config and its SP groups (collective)."""
    from xfuser.core.distributed import get_sp_group

    engine = getattr(pipe, "engine_config", None)
    if engine is None or not hasattr(pipe, "transformer"):
        raise ValueError(f"enable takes an xfuser pipeline (xFuserFluxPipeline, xFuserCogVideoXPipeline) after it is "
                         f"built; got {type(pipe).__name__}")
    par, runtime = engine.parallel_config, engine.runtime_config
    worlds: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(worlds, tuple(get_sp_group().ranks))
    return XDiTJob(model=model_name(pipe.transformer), sp_worlds=tuple(dict.fromkeys(worlds)),
                   world_size=dist.get_world_size(), ulysses=par.ulysses_degree, ring=par.ring_degree,
                   pipefusion=par.pp_degree, pipeline_patches=par.pp_config.num_pipeline_patch or 1,
                   tensor_parallel=par.tp_degree, fast_attn=engine.fast_attn_config.use_fast_attn,
                   fp8_comms=runtime.use_fp8_comms, vae_workers=par.vae_parallel_size,
                   attention_backend=runtime.attention_backend, hybrid_attention=runtime.use_hybrid_attn_schedule,
                   onediff=runtime.use_onediff)


def _split_text() -> bool:
    from xfuser.core.distributed import get_runtime_state

    return bool(get_runtime_state().split_text_embed_in_sp)


def _launched_machines() -> int:
    """Machines of a torchrun job: its processes over the processes per machine."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return max(1, dist.get_world_size() // local)


def enable(pipe: Any, method: str = "auto", machines: int | None = None, backend: str = "torch",
           **config: Any) -> ParallelContext | None:
    """Run the attention of a built xfuser Flux / CogVideoX pipeline through `sp_attention`; every rank calls it.

    method, backend and `config` (ulysses, ring, torus, kernel, emulate_link, recipe, timeout_s, strict) are
    ParallelConfig's, with its default: method "auto" picks the layout for each attention shape over one of xfuser's SP groups
    (choice.choose: a recipe entry for that cluster, else the cost model). machines: how many machines the job runs on (None: WORLD_SIZE / LOCAL_WORLD_SIZE as torchrun
    sets them). Unsupported set-ups (PipeFusion, its KV cache, tensor parallelism, DiTFastAttn, FP8 comms,
    separate VAE workers, quantized or sparse attention backends, the hybrid attention schedule, OneDiff, other
    models) raise ValueError naming what to turn off, before anything changes.
    Returns the context, or None when xfuser runs no sequence parallelism (nothing to replace).
    """
    if importlib.util.find_spec("xfuser") is None:
        raise ModuleNotFoundError(f"streamfusion_diffusers.xdit.enable {missing('xfuser')}", name="xfuser")
    job = read_job(pipe)
    refuse_unsupported(job)
    if job.sp_degree == 1:
        if dist.get_rank() == 0:
            logger.info("streamfusion: xfuser runs no sequence parallelism (ulysses x ring = 1); nothing to replace")
        return None
    machines = machines if machines is not None else _launched_machines()
    key = (parallel_config(job, method, machines, backend, **config), job.sp_worlds)
    contexts: dict[tuple[Any, ...], ParallelContext] = pipe.__dict__.setdefault(CONTEXTS, {})
    if key not in contexts:
        first = next(iter(contexts.values()), None)
        contexts[key] = init_parallel(key[0], worlds=job.sp_worlds, groups=first.groups if first else None)
    ctx = contexts[key]
    install(pipe.transformer, ctx, _split_text)
    if dist.get_rank() == 0:
        if job.attention_backend is not None:
            logger.info("streamfusion: xfuser's --attention_backend %s is not used while ours runs (kernel=%s)",
                        job.attention_backend, ctx.config.kernel)
        runs = ("the layout choice.choose picks at the first attention call" if ctx.config.method == "auto"
                else ctx.layout(pipe.transformer.config.num_attention_heads))
        logger.info("streamfusion: xfuser's %s attention now runs %s in each of its %d sequence-parallel groups",
                    job.model, runs, len(job.sp_worlds))
    return ctx


def disable(pipe: Any) -> None:
    """Give the pipeline xfuser's own attention back (the process groups stay until the job ends)."""
    uninstall(pipe.transformer)
