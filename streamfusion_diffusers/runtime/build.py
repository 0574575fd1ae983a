"""The pipeline's build on one rank, and what one call of it needs: the one place `generate` and `serve` build
and call a job's pipeline (what a call says it ran: record.py).
"""
from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import init_parallel
from ..context import ParallelContext
from ..core.logs import say_once
from ..kernels import dispatch
from ..models.pipelines import family_of
from . import startup
from .invariant import rows_invariant
from .arguments import DTYPES
from .job import Job, real_size
from .fork_server import PIPELINE_MODULES

logger = logging.getLogger(__name__)


@dataclass
class Prepared:
    """One rank's pipeline, built and parallelized once: `generate` calls it once, `serve` once per request."""

    pipe: Any
    ctx: ParallelContext
    transformer: Any
    device: torch.device
    prompt: dict[str, Any]  # {"prompt": text}, or the job's prompt encoded before the transformer was built
    stack: dict[str, Any]  # the cache, LoRAs and quantization that ran ({} for none)
    build_s: float
    startup_s: dict[str, float]  # this rank's start-up by stage, the build included (startup.py)


_ahead: threading.Thread | None = None  # import_ahead's thread, in a rank that started one


def import_ahead() -> None:
    """Start importing what `prepare` imports (diffusers, and transformers for the text encoders: most of a rank's
    start-up) in a thread, so that it runs while the process group's join waits on the peers and NCCL's set-up
    (GPU jobs: on the CPU the join is short and the import would only contend with the peers' for the cores).
    `prepare` waits for it; an import that fails here fails again in `prepare`, which reports it."""
    global _ahead

    def run() -> None:
        try:
            _pipeline_modules()
        except BaseException:  # noqa: BLE001 - prepare's own import raises it where it is reported
            pass

    _ahead = threading.Thread(target=run, name="streamfusion-import-ahead", daemon=True)
    _ahead.start()


def _pipeline_modules() -> None:
    for name in PIPELINE_MODULES:
        importlib.import_module(name)


def prepare(job: Job) -> Prepared:
    """Build the job's pipeline on this rank and parallelize it."""
    if _ahead is not None:
        _ahead.join()
    from diffusers.utils import logging as diffusers_logging  # diffusers is an extra: imported only to run

    from ..models.build import build_pipeline, load_pipeline
    from ..models.full import build_full_pipeline, encode_first
    from ..diffusers.compiled import compile_transformers
    from ..diffusers.parallel_pipeline import parallelize
    from ..diffusers.stack.apply import apply_stack

    startup.mark("diffusers imported")
    family = family_of(job.model)
    rank = dist.get_rank()
    if rank != 0:  # progress (loading, denoising) on rank 0 only
        diffusers_logging.disable_progress_bar()
    if job.deterministic:
        pin_choices()
    device = torch.device("cuda", torch.cuda.current_device()) if job.gpu else torch.device("cpu")
    dtype = DTYPES[job.dtype]
    ctx = init_parallel(job.parallel)
    started = time.perf_counter()
    prompt: dict[str, Any] = {"prompt": job.prompt}
    # sharded weights (on more than one rank, where the whole pipeline does not fit: `_whole_fits`; on one rank
    # they are a no-op): held (or loaded) in host memory, each rank's shards then moved to its GPU one block at a
    # time by parallelize, so no GPU holds a whole model; random ones are made on the GPU a part at a time where
    # each part fits (`_builds_on`), then parked there
    shards = job.shard_weights and job.world_size > 1 and not _whole_fits(job, device)
    home = torch.device("cpu") if shards and real_size(job.model) else device
    made_on = device if home != device and not job.weights and _builds_on(job.model, device) else home
    if job.weights:
        pipe = load_pipeline(job.model, job.weights, dtype=dtype, device=home)
    elif real_size(job.model) and family.encode_first and not shards:  # encoder and transformer do
        # not fit one GPU together
        pipe, prompt = encode_first(job.model, job.prompt, job.max_sequence_length, seed=job.weights_seed,
                                    dtype=dtype, device=device)
    else:
        # real-size models get real-size text encoders and VAE too, so the phases are the ones a user waits for
        build = build_full_pipeline if real_size(job.model) else build_pipeline
        pipe = build(job.model, seed=job.weights_seed, dtype=dtype, device=made_on,
                     park=home if made_on != home else None)
        if made_on.type == "cuda":
            torch.cuda.empty_cache()  # what the parked parts left in the allocator's cache
    if rank == 0:  # where a long start-up goes (-v shows it)
        logger.info("pipeline made in %.1f s (%s)", time.perf_counter() - started,
                    job.weights or f"random weights made on {made_on}, held on {home}")
    stack = apply_stack(pipe, job.stack)  # before parallelize: diffusers/stack/caches.py says why
    if not job.gpu:  # an image the same alone and in a batch (invariant.py); before parallelize's hooks wrap forward
        rows_invariant(pipe)
    streamed = streamed_choice(job, pipe) if shards else "gather"
    budget = weight_budget(job, pipe, device, streamed) if shards else None
    transformer = parallelize(pipe, ctx, vae=job.vae_split, cuda_graph=job.cuda_graph, shard_weights=shards,
                              streamed=streamed, weight_budget=budget)
    if rank == 0:
        logger.info("parallelized in %.1f s in all%s", time.perf_counter() - started,
                    f" (sharded: {', '.join(transformer._streamfusion.sharded)})" if shards else "")
    if home != device:  # what was not sharded (the VAE, small encoders); the shards are on the GPU already
        for name, part in pipe.components.items():
            if isinstance(part, torch.nn.Module) and name not in transformer._streamfusion.sharded:
                part.to(device)
    if job.compile:
        compile_transformers(pipe, job.compile_cache)
    pipe.set_progress_bar_config(disable=rank != 0, desc=f"{job.model} {job.parallel.label}")
    startup.mark("built")
    return Prepared(pipe, ctx, transformer, device, prompt, stack, time.perf_counter() - started, startup.split())


def _whole_fits(job: Job, device: torch.device) -> bool:
    """--shard-weights on GPUs that hold the whole pipeline beside a step (the planner's split would keep every
    part whole, within --max-memory or the memory free now, the least over the ranks): nothing to shard, so the
    job builds and runs as without it, instead of making the weights in host memory and moving them back."""
    if device.type != "cuda" or not real_size(job.model):
        return False
    from ..models.memory import GIB, estimate

    free = torch.tensor([job.max_memory or torch.cuda.mem_get_info(device)[0] / GIB], dtype=torch.float64,
                        device=device)
    dist.all_reduce(free, op=dist.ReduceOp.MIN)
    e = estimate(job.model, job.height, job.width, job.frames, job.world_size, cfg=_cfg(job), sharded=True,
                 max_memory=free.item())
    if e.streams:
        return False
    say_once(logger, logging.WARNING, "--shard-weights: the whole pipeline fits these GPUs beside a step (%.1f of "
             "%.1f GiB, streamfusion plan --memory): nothing to shard, it runs as without the flag", e.peak,
             free.item())
    return True


def _builds_on(model: str, device: torch.device) -> bool:
    """Whether the GPU can make a pipeline's random weights to be sharded, one part after another (each moved to
    host memory once made): its largest transformer, and its encoders and VAE together, fit the free memory."""
    from ..models.memory import pipeline_parts

    if device.type != "cuda":
        return False
    parts = pipeline_parts(model)  # a meta build: asked only where a GPU could make them
    transformers = [p.total for name, p in parts.items() if name.startswith("transformer")]
    rest = sum(p.total for name, p in parts.items() if not name.startswith("transformer"))
    return max([*transformers, rest]) < 0.9 * torch.cuda.mem_get_info(device)[0]


def pin_choices() -> None:
    """--deterministic: no choice of this process depends on a timing or on what ran before it: the attention
    kernel and SDPA backend by rule (kernels/dispatch.py), cuDNN's algorithms fixed, cuBLAS's reproducible
    workspaces, and torch's deterministic algorithms where they exist (a warning names an op that has none).
    Method "auto" needs nothing: its layout comes from the recipe or the cost model, untimed, broadcast by rank 0."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when this process's cuBLAS starts
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    dispatch.pin()


def call_kwargs(job: Job, prepared: Prepared) -> dict[str, Any]:
    """The pipeline call for the job's prompt, size, steps and seed (a fresh seeded CPU generator per call, so
    the same job gives the same pixels however often it runs); rank 0 decodes to PIL (an image's pixels through
    output_type "pt": output.py's `to_pil` makes them on the device)."""
    rank = dist.get_rank()
    prompt = prepared.prompt if "prompt_embeds" in prepared.prompt else {"prompt": job.prompt}
    return dict(**prompt, height=job.height, width=job.width, num_inference_steps=job.steps,
                generator=torch.Generator("cpu").manual_seed(job.seed),
                output_type=("pil" if job.spec.video else "pt") if rank == 0 else "pt" if job.vae_split else "latent",
                **family_of(job.model).call_kwargs(job.spec, job.frames, job.guidance_scale, job.true_cfg_scale,
                                                   job.max_sequence_length),
                **family_of(job.model).size_kwargs(job.height, job.width))


def _parts(pipe: Any) -> dict:
    from ..diffusers.weight_split import part_sizes

    return {name: part_sizes(c) for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)}


def _cfg(job: Job) -> int:
    return job.parallel.cfg if isinstance(job.parallel.cfg, int) else 1


def streamed_choice(job: Job, pipe: Any) -> str:
    """How the sharded run's streamed blocks run: --streamed-blocks, or for "auto" the way that moves fewer bytes
    a step at the job's size (plan --memory's figures: the weights the gathers receive against the token rows the
    tensor-parallel blocks' all-reduces carry)."""
    if job.streamed_blocks != "auto":
        return job.streamed_blocks
    from ..models.memory import streamed_choice as fewer_bytes

    return fewer_bytes(job.model, job.height, job.width, job.frames, job.world_size, cfg=_cfg(job),
                       parts=_parts(pipe))


def weight_budget(job: Job, pipe: Any, device: torch.device, streamed: str = "gather") -> int | None:
    """Bytes per rank the sharded weights may hold: --max-memory (default on GPUs: the memory free now) less the
    activations (those of tensor-parallel blocks, which hold every token, with `streamed` "tensor"), the VAE and a
    margin (models/memory.py's `weight_budget`), the least over the ranks (they must agree on the split); None on
    the CPU without --max-memory: every block sharded."""
    from ..models.memory import GIB, estimate, unsharded
    from ..models.memory import weight_budget as budget_of

    total = job.max_memory
    if total is None:
        if device.type != "cuda":
            return None
        total = torch.cuda.mem_get_info(device)[0] / GIB
    parts = _parts(pipe)
    e = estimate(job.model, job.height, job.width, job.frames, job.world_size, cfg=_cfg(job), sharded=True,
                 parts=parts, streamed=streamed)
    budget = torch.tensor([budget_of(total, e.activations + e.attention, unsharded(parts), e.vae_decode)],
                          dtype=torch.int64, device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(budget, op=dist.ReduceOp.MIN)
    return int(budget.item())


def no_autograd(job: Job) -> Any:
    """How the pipeline call runs: under inference_mode, sharded weights too (their gathers write into buffers
    made outside it, which inference mode allows; tests/test_shard_weights_p4.py runs them under it)."""
    return torch.inference_mode()


__all__ = ["Prepared", "call_kwargs", "import_ahead", "no_autograd", "pin_choices", "prepare", "streamed_choice",
           "weight_budget"]
