"""Whole generations timed per phase: text encoding, every denoising step and the VAE decode, for each system.

What a user waits for. Every rank builds the same pipeline (on GPUs the real-size transformer, text encoders and
VAE with seeded random weights, `models/full.py`; tiny ones on the CPU) and every system generates with the same
prompt, seed and steps: one warm-up generation, then `iters` timed ones, each phase CUDA-synchronized
(`PhaseTimer`), the slowest rank's time per repetition. The systems:

- one-gpu: the plain diffusers pipeline on rank 0 alone while the other ranks wait at a barrier. Its output is
  the reference of every other system; its final latents decoded by diffusers' tiled decode are the reference
  of the systems that split the VAE decode by diffusers' tiles (VAEs the exact patch-parallel decode cannot take);
  our rows record how the VAE decoded (`vae_decode`);
- ours: `parallelize` with method "auto" (the recipe's or the cost model's layout) and the VAE decode split;
  ours-no-vae-split (rank 0 decodes alone); ours-cfg (the guidance branches on halves of the ranks);
- diffusers-cp (every model but CogVideoX, which has no diffusers plan; GPUs): diffusers' own context parallelism
  at one Ulysses x Ring layout;
- xfuser (CogVideoX, GPUs): xFuserCogVideoXPipeline at one layout, CFG parallel included (xfuser has no
  parallel VAE for CogVideoX: every rank decodes the whole video);
- cache-dit, cache-dit-fp8, cache-dit-async (GPUs): Cache-DiT's parallelism at one layout, caching off
  (`bench/cachedit.py`).
Baselines get a fresh transformer each (diffusers' and xfuser's changes to it cannot be undone).
"""
from __future__ import annotations

import gc
import statistics
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from diffusers import ContextParallelConfig
from torch import Tensor

from .. import ParallelConfig, init_parallel
from ..commands.timing import deadline
from ..core.config import degrees_label
from ..core.exactness import relative_error
from ..diffusers.parallel_pipeline import parallelize, unparallelize
from ..models import MODELS
from ..models.build import build_pipeline, build_transformers
from ..models.full import build_full_pipeline, encode_first
from ..models.pipelines import family_of
from ..runtime import images
from ..runtime.phases import PHASES, PhaseTimer
from . import cachedit
from .layer import device_of_job

OURS = ("ours", "ours-no-vae-split", "ours-cfg")
BASELINES = ("diffusers-cp", "xfuser", *cachedit.SYSTEMS)  # each takes a fresh transformer, changed for good


@dataclass(frozen=True)
class E2ECase:
    """One timed system; baselines carry their Ulysses x Ring degrees and CFG degree."""

    system: str
    ulysses: int = 1
    ring: int = 1
    cfg: int = 1

    @property
    def label(self) -> str:
        if self.system in BASELINES:
            return f"{self.system} {'cfg2 ' if self.cfg > 1 else ''}{degrees_label(self.ulysses, self.ring)}"
        return self.system


@dataclass(frozen=True)
class E2ESetup:
    """One workload's generation, the same for every system."""

    name: str
    model: str  # a models.MODELS key
    full: bool  # real-size text encoders and VAE
    height: int
    width: int
    frames: int
    steps: int
    guidance_scale: float
    true_cfg_scale: float | None
    max_sequence_length: int
    prompt: str
    seed: int
    dtype: torch.dtype
    machines: int
    gpus_per_machine: int
    backend: str = "torch"
    recipe: str | None = None
    comm_dtype: str | None = None
    emulate_link: str | None = None  # ours only: the inter-machine link its transfers are slowed to
    iters: int = 3
    warmup: int = 1
    timeout_s: float = 300.0
    encoded: dict[str, Tensor] | None = None  # the prompt's call arguments, encoded before the transformer was built

    def call(self, output_type: str) -> dict[str, Any]:
        spec = MODELS[self.model]
        prompt = {"prompt": self.prompt} if self.encoded is None else self.encoded
        return dict(**prompt, height=self.height, width=self.width, num_inference_steps=self.steps,
                    generator=torch.Generator("cpu").manual_seed(self.seed), output_type=output_type,
                    **family_of(self.model).call_kwargs(spec, self.frames, self.guidance_scale, self.true_cfg_scale,
                                                        self.max_sequence_length),
                    **family_of(self.model).size_kwargs(self.height, self.width), **self.input_image())

    def input_image(self) -> dict[str, Any]:
        """An edit model's input image: a blank one of the output's size (its tokens are what an edit adds)."""
        family = family_of(self.model)
        if not family.needs_image:
            return {}
        return family.image_kwargs(MODELS[self.model], [images.decode(images.blank(self.width, self.height))])


def build(setup: E2ESetup, device: torch.device) -> tuple[Any, E2ESetup]:
    """The workload's pipeline, and the setup to call it with: a family whose real-size encoder and transformer do
    not fit one GPU together (Flux.2) is encoded first, tiny or real, as `streamfusion generate` does at real size,
    and every generation takes the embeddings."""
    gc.collect()  # the previous workload's pipeline: its hooks form reference cycles
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if family_of(setup.model).encode_first:
        pipe, encoded = encode_first(setup.model, setup.prompt, setup.max_sequence_length, seed=setup.seed,
                                     dtype=setup.dtype, device=device)
        setup = replace(setup, encoded=encoded)
    else:
        build = build_full_pipeline if setup.full else build_pipeline
        pipe = build(setup.model, seed=setup.seed, dtype=setup.dtype, device=device)
    pipe.set_progress_bar_config(disable=True)
    return pipe, setup


def _output(result: Any, output_type: str) -> Tensor | None:
    if output_type == "latent":
        return None
    return result.images if hasattr(result, "images") else result.frames


def _repeat(pipe: Any, setup: E2ESetup, output_type: str, device: torch.device,
            together: bool = True) -> tuple[list[dict[str, float]], Tensor | None]:
    """`warmup` untimed then `iters` timed generations: each one's seconds per phase, and the last output."""
    runs, out = [], None
    for i in range(setup.warmup + setup.iters):
        if together:
            dist.barrier()
        timer = PhaseTimer(device)
        with torch.inference_mode():
            out = _output(timer.call(pipe, **setup.call(output_type)), output_type)
        if i >= setup.warmup:
            runs.append(timer.seconds)
    return runs, out


def _slowest(runs: list[dict[str, float]], iters: int, device: torch.device) -> dict[str, dict[str, float]]:
    """Min / median / max seconds per phase over repetitions, each the slowest rank's (ranks that ran nothing
    pass no runs)."""
    times = torch.zeros(iters, len(PHASES), dtype=torch.float64, device=device)
    if runs:
        times = torch.tensor([[r[p] for p in PHASES] for r in runs], dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return {p: {"min": min(col), "median": statistics.median(col), "max": max(col)}
            for p, col in zip(PHASES, times.T.tolist())}


def _tiled_decode(pipe: Any, z: Tensor, model: str) -> Tensor:
    """z decoded by diffusers' tiled decode and post-processed as the pipeline does ("pt")."""
    pipe.vae.enable_tiling()
    try:
        with torch.inference_mode():
            sample = pipe.vae.decode(z, return_dict=False)[0]
    finally:
        pipe.vae.disable_tiling()
    return family_of(model).postprocess(MODELS[model], pipe, sample)


def _one_gpu(pipe: Any, setup: E2ESetup, device: torch.device,
             timed: bool) -> tuple[dict | None, dict[str, Tensor] | None]:
    """Rank 0 generates alone (timed, or once for the reference); returns its phases and the references."""
    runs, refs = [], None
    if dist.get_rank() == 0:
        seen: list[Tensor] = []
        decode = pipe.vae.decode
        pipe.vae.decode = lambda z, *a, **k: (seen.append(z), decode(z, *a, **k))[1]
        try:
            once = setup if timed else replace(setup, iters=1, warmup=0)
            runs, out = _repeat(pipe, once, "pt", device, together=False)
        finally:
            del pipe.vae.decode
        refs = {"untiled": out, "tiled": _tiled_decode(pipe, seen[-1], setup.model)}
    dist.barrier()
    return (_slowest(runs, setup.iters, device) if timed else None), refs


def _ours(pipe: Any, setup: E2ESetup, case: E2ECase,
          device: torch.device) -> tuple[dict, Tensor | None, str, str | None]:
    """Our rows; the last value is how the VAE decoded over the ranks (None: rank 0 alone)."""
    config = ParallelConfig(machines=setup.machines, gpus_per_machine=setup.gpus_per_machine, method="auto",
                            backend=setup.backend, recipe=setup.recipe, comm_dtype=setup.comm_dtype,
                            emulate_link=setup.emulate_link, cfg=2 if case.system == "ours-cfg" else 1)
    ctx = init_parallel(config)
    split = case.system != "ours-no-vae-split"
    vae_decode = parallelize(pipe, ctx, vae=split)._streamfusion.vae_decode
    try:
        runs, out = _repeat(pipe, setup, "pt" if split or dist.get_rank() == 0 else "latent", device)
        layout = str(ctx.layout(pipe.transformer.config.num_attention_heads))
    finally:
        unparallelize(pipe)
    return (_slowest(runs, setup.iters, device), out, (f"cfg 2 x {layout}" if config.cfg == 2 else layout),
            vae_decode)


def _fresh(pipe: Any, setup: E2ESetup, device: torch.device) -> Any:
    """The same pipeline around new transformers with the same weights."""
    transformers = build_transformers(setup.model, seed=setup.seed, dtype=setup.dtype, device=device)
    fresh = type(pipe)(**{**pipe.components, **transformers}, **family_of(setup.model).pipeline_kwargs(
        MODELS[setup.model]))
    fresh.set_progress_bar_config(disable=True)
    return fresh


def _diffusers_cp(pipe: Any, setup: E2ESetup, case: E2ECase, device: torch.device) -> tuple[dict, Tensor]:
    cp = _fresh(pipe, setup, device)
    if setup.dtype in (torch.float16, torch.bfloat16):
        cp.transformer.set_attention_backend("_native_cudnn")  # diffusers' native SDPA has no LSE for the ring
    cp.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=case.ulysses,
                                                                   ring_degree=case.ring))
    runs, out = _repeat(cp, setup, "pt", device)
    return _slowest(runs, setup.iters, device), out


def _xfuser(pipe: Any, setup: E2ESetup, case: E2ECase, device: torch.device) -> tuple[dict, Tensor]:
    """xfuser imported here only: it refuses to import without a GPU. It joins the job's process group (its world
    group made from ours) and makes its CFG / SP groups per layout, destroyed after."""
    from xfuser import xFuserArgs, xFuserCogVideoXPipeline
    from xfuser.core.distributed.parallel_state import (
        destroy_model_parallel,
        init_distributed_environment,
        model_parallel_is_initialized,
    )

    init_distributed_environment(world_size=dist.get_world_size(), rank=dist.get_rank(), local_rank=device.index)
    if model_parallel_is_initialized():
        destroy_model_parallel()
    engine_config, _ = xFuserArgs(model="random-weights", ulysses_degree=case.ulysses, ring_degree=case.ring,
                                  use_cfg_parallel=case.cfg > 1).create_config()
    xpipe = xFuserCogVideoXPipeline(_fresh(pipe, setup, device), engine_config)
    runs, out = _repeat(xpipe, setup, "pt", device)
    destroy_model_parallel()
    return _slowest(runs, setup.iters, device), out


def _cache_dit(pipe: Any, setup: E2ESetup, case: E2ECase, device: torch.device) -> tuple[dict, Tensor, str]:
    fresh = _fresh(pipe, setup, device)
    cachedit.enable(fresh, case.system, case.ulysses, case.ring)
    runs, out = _repeat(fresh, setup, "pt", device)
    return (_slowest(runs, setup.iters, device), out,
            cachedit.layout(case.system, case.ulysses, case.ring, cachedit.parallel_vae(fresh)))


def bench_e2e(setup: E2ESetup, cases: list[E2ECase]) -> list[dict]:
    """Run on every rank; one row per case (phases: the slowest rank's min / median / max seconds; rel_err of
    rank 0's output against the one-GPU pipeline's; peak memory: the largest rank's)."""
    device = device_of_job()
    with deadline(setup.timeout_s):
        pipe, setup = build(setup, device)
    rows = []
    timed = any(c.system == "one-gpu" for c in cases)
    # one-gpu first (the reference), baselines last: each of them changes its fresh transformer for good
    ordered = sorted(cases, key=lambda c: (c.system != "one-gpu", c.system in BASELINES))
    if not timed:
        ordered.insert(0, E2ECase("one-gpu"))
    refs: dict[str, Tensor] | None = None
    for case in ordered:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with deadline(setup.timeout_s * (setup.warmup + setup.iters + 1)):
            out, ref_kind, layout, vae_decode = None, "untiled", case.label, None
            if case.system == "one-gpu":
                phases, refs = _one_gpu(pipe, setup, device, timed)
                layout = "1 GPU, the others idle"
            elif case.system in OURS:
                phases, out, layout, vae_decode = _ours(pipe, setup, case, device)
                ref_kind = "tiled" if vae_decode == "tiles" else "untiled"  # patch-parallel and whole: exact
            elif case.system in cachedit.SYSTEMS:
                phases, out, layout = _cache_dit(pipe, setup, case, device)
            elif case.system == "diffusers-cp":
                phases, out = _diffusers_cp(pipe, setup, case, device)
                layout = f"ulysses_degree={case.ulysses}, ring_degree={case.ring}"
            else:
                phases, out = _xfuser(pipe, setup, case, device)
                layout = (f"{'--use_cfg_parallel ' if case.cfg > 1 else ''}--ulysses_degree {case.ulysses} "
                          f"--ring_degree {case.ring}")
        peak = torch.tensor(torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0,
                            dtype=torch.float64, device=device)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        gc.collect()  # a baseline's transformer, kept alive by its hooks' reference cycles until collected
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if phases is None:  # the untimed reference run
            continue
        if dist.get_rank() == 0:
            print(f"e2e {setup.name} {case.label}: " + ", ".join(f"{p} {phases[p]['median']:.3f} s" for p in PHASES),
                  flush=True)
        rel = (relative_error(out, refs[ref_kind]) if out is not None and refs is not None
               and case.system != "one-gpu" else None)
        rows.append(dict(workload=setup.name, system=case.system, case=case.label, layout=layout, phases=phases,
                         rel_err=rel, reference=None if case.system == "one-gpu" else f"one-gpu, {ref_kind} decode",
                         vae_decode=vae_decode,
                         peak_gib=peak.item() if device.type == "cuda" else None, steps=setup.steps,
                         iters=setup.iters))
    return rows


__all__ = ["BASELINES", "OURS", "E2ECase", "E2ESetup", "bench_e2e", "build"]
