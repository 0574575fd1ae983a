"""What one `streamfusion generate` run is: the validated Job its options (arguments.py) make.

Everything is checked here, before any process starts or any model is built: the layout against the heads,
the CFG split against the cluster, the token count against the ranks, the recipe file for method "auto".
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import ParallelConfig
from ..choice.recipe import load_recipes
from ..core.config import cfg_shape, resolve_layout
from ..core.extras import missing
from ..core.join import launched
from ..core.links import parse_link
from ..diffusers.compiled import default_cache
from ..diffusers.stack.spec import Stack, parse_stack
from ..models import MODELS, TINY, ModelSpec
from ..models.pipelines import adapter
from .arguments import DTYPES, SPAWN_SHAPE, WEIGHTS_SEED
from .execution import compile_choice, graph_choice
from .images import read as read_image

@dataclass(frozen=True)
class Job:
    """Everything every rank needs to run the same generation."""

    model: str
    weights: str | None
    prompt: str
    height: int
    width: int
    frames: int
    steps: int
    guidance_scale: float | None
    true_cfg_scale: float | None
    max_sequence_length: int
    seed: int
    dtype: str
    parallel: ParallelConfig
    world_size: int
    gpu: bool
    output: str
    vae_split: bool = True
    cuda_graph: bool = False  # replay the forward from CUDA graphs (resolved: on by default on GPUs)
    graph_why: str = "not asked for"  # why graphs are on or off (run.json says it)
    compile: bool = False  # the repeated blocks compiled (resolved: where measured to pay, on GPUs)
    compile_why: str = "not asked for"  # why they are or are not (run.json says it)
    compile_cache: str | None = None  # the folder inductor keeps its compiles in (None: nothing compiles)
    shard_weights: bool = False
    max_memory: float | None = None  # GiB per GPU with sharded weights (None: the GPU's free memory; CPU: no limit)
    streamed_blocks: str = "auto"  # how a sharded block that streams runs: gathered, tensor-parallel or fewer bytes
    stack: Stack = Stack()  # the cache, LoRAs and quantization stacked on the pipeline
    weights_seed: int = WEIGHTS_SEED  # random weights' seed (not the generation's)
    deterministic: bool = False  # every kernel and backend choice pinned, none timed
    images: tuple[bytes, ...] = ()  # input images' files (`--image`), checked (runtime/images.py)

    @property
    def spec(self) -> ModelSpec:
        return MODELS[self.model]


def guided(spec: ModelSpec, guidance_scale: float | None, true_cfg_scale: float | None) -> bool:
    """Whether the pipeline runs two guidance branches: CogVideoX and Wan with guidance > 1, Flux and
    Qwen-Image with true CFG > 1 (Flux's guidance_scale is distilled guidance, one branch; Flux.2 has only that)."""
    return adapter(spec.family).guided(guidance_scale, true_cfg_scale)


def cfg_degree(option: str, is_guided: bool) -> int:
    """--cfg-parallel as a CFG degree: 'auto' takes 2 when guidance is on; 2 without guidance is an error."""
    if option == "auto":
        return 2 if is_guided else 1
    if option == "2" and not is_guided:
        raise ValueError("--cfg-parallel needs two guidance branches: CogVideoX or Wan with --guidance-scale > 1, "
                         "Flux or Qwen-Image with --true-cfg-scale > 1 (Flux.2 has none); or drop --cfg-parallel")
    return int(option)


def real_size(model: str) -> bool:
    return not model.startswith("tiny-")


def cluster(args: argparse.Namespace) -> tuple[int, int, bool]:
    """(machines, processes per machine, GPUs or not): torchrun's job; else one process per visible GPU on one
    machine, the way torchrun would start them; else (--cpu, or no GPU) gloo processes on the CPU. A real-size
    model without a GPU only with --cpu."""
    visible = 0 if args.cpu else torch.cuda.device_count()
    if visible == 0 and real_size(args.model) and not args.cpu:
        raise ValueError(f"{args.model} is a real-size model and no GPU is visible: run the same command where GPUs "
                         f"are (one process per GPU), or here `streamfusion generate --model "
                         f"{TINY[args.model]}`, or add --cpu to run {args.model} on the CPU "
                         f"anyway (slow, tens of GB of memory per process)")
    if launched():
        world = int(os.environ["WORLD_SIZE"])
        machines = args.machines or max(world // int(os.environ.get("LOCAL_WORLD_SIZE", world)), 1)
        per_machine = args.gpus_per_machine or world // machines
        if machines * per_machine != world:
            raise ValueError(f"--machines {machines} x --gpus-per-machine {per_machine} is not the {world} ranks "
                             f"torchrun started")
        return machines, per_machine, visible > 0
    if visible == 0:
        return args.machines or SPAWN_SHAPE[0], args.gpus_per_machine or SPAWN_SHAPE[1], False
    machines = args.machines or 1
    per_machine = args.gpus_per_machine or max(visible // machines, 1)
    if machines * per_machine > visible:
        raise ValueError(f"--machines {machines} x --gpus-per-machine {per_machine} needs {machines * per_machine} "
                         f"GPUs and {visible} are visible: ask for fewer, or add --cpu for gloo processes on the CPU")
    return machines, per_machine, True


def check_size(spec: ModelSpec, height: int, width: int, frames: int | None) -> None:
    """Sizes the pipeline runs as given (it would round others silently)."""
    step = spec.size_step
    for name, value in (("--height", height), ("--width", width)):
        if value % step:
            raise ValueError(f"{name} {value}: must be a multiple of {step} for this model "
                             f"(e.g. {max(step, value // step * step)})")
    if frames is None:
        return
    if not spec.video:
        raise ValueError("--frames is for video models (CogVideoX, Wan); drop it")
    refusal = spec.frames_refusal(frames)
    if refusal:
        raise ValueError(f"--frames {frames}: {refusal}")


def check_guidance(model: str, guidance_scale: float | None, true_cfg_scale: float | None, cfg_parallel: str
                   ) -> None:
    """Guidance options the model's pipeline takes (it would fail on the others, or ignore them); --cfg-parallel
    on a guidance-distilled model, which has no guidance branches to split."""
    spec = MODELS[model]
    by_true_cfg = adapter(spec.family).cfg_by == "true_cfg_scale"
    distilled = spec.guidance_scale is None and not by_true_cfg
    if distilled and (guidance_scale, true_cfg_scale) != (None, None):
        option = "--guidance-scale" if guidance_scale is not None else "--true-cfg-scale"
        raise ValueError(f"{model} takes no guidance (guidance-distilled): drop {option}")
    if distilled and cfg_parallel == "2":
        raise ValueError(f"{model} takes no guidance (guidance-distilled): drop --cfg-parallel")
    if guidance_scale is not None and spec.guidance_scale is None:
        raise ValueError(f"{model} has no --guidance-scale (it guides by true CFG): use --true-cfg-scale")
    if true_cfg_scale is not None and not by_true_cfg:
        raise ValueError(f"--true-cfg-scale is for Flux.1 and Qwen-Image; {model} guides by --guidance-scale, "
                         f"drop --true-cfg-scale")


def check_images(model: str, count: int, option: str = "--image") -> None:
    """As many input images as the model's pipeline takes: an edit model needs one; others take none, or up to
    their count (models/configs.py ModelSpec.images)."""
    spec = MODELS[model]
    takers = ", ".join(name for name, s in MODELS.items() if s.images and not real_size(name))
    if count > spec.images:
        raise ValueError(f"{option}: {model} takes {spec.images or 'no'} input image{'s' * (spec.images != 1)}, got "
                         f"{count}" + ("" if spec.images else f"; models that take one: {takers}"))
    if count == 0 and adapter(spec.family).needs_image:
        raise ValueError(f"{option} PATH: {model} edits an input image; give one")


def check_quantized_attention(kernel: str, gpu: bool) -> None:
    """--attention int8|fp8 where 8-bit tensor cores run it (this machine's first GPU stands for the job's)."""
    from ..kernels.choice import quantized_needs, quantized_supported

    if not (gpu and quantized_supported(kernel)):
        needs = quantized_needs(kernel).removeprefix(f"kernel {kernel!r} ")
        raise ValueError(f"--attention {kernel} {needs}; drop --attention {kernel} here")


def check_link(spec: str, machines: int, serving: bool) -> None:
    """--emulate-link: a link the emulated transport knows, and machines for it to lie between."""
    try:
        parse_link(spec)
    except ValueError as err:
        raise ValueError(f"--emulate-link: {err} (e.g. p4de or 25:10)") from None
    if machines < 2:
        where = ("each group of --replicas lies inside one machine: use fewer --replicas or more --machines"
                 if serving else "the job runs on one machine: add --machines N (N > 1)")
        raise ValueError(f"--emulate-link {spec} slows what crosses machines, and {where}, or drop --emulate-link")


def given(value: Any, default: Any) -> Any:
    """A given option's value, else the default: a given 0 stays 0."""
    return default if value is None else value


def make_job(args: argparse.Namespace, shape: tuple[int, int, bool] | None = None,
             serving: bool = False) -> Job:
    """Resolve defaults and check the layout against the model, before any process starts. shape: (machines,
    processes per machine, GPUs or not) where the caller resolved it (serve: one replica group's), else
    `cluster(args)`. `serving`: the requests bring their input images (`serve`), so the job takes none."""
    if importlib.util.find_spec("diffusers") is None:
        raise ValueError(f"streamfusion generate {missing('diffusers')}")
    machines, gpus_per_machine, gpu = shape or cluster(args)
    world = machines * gpus_per_machine
    spec = MODELS[args.model]
    height, width = given(args.height, spec.height), given(args.width, spec.width)
    check_size(spec, height, width, args.frames)
    frames = given(args.frames, spec.frames)
    if args.recipe and args.method != "auto":
        raise ValueError(f"--recipe is what --method auto reads; drop --method {args.method} or --recipe")
    parallel = ParallelConfig(machines=machines, gpus_per_machine=gpus_per_machine, method=args.method,
                              ulysses=args.ulysses, ring=args.ring, torus=args.torus, recipe=args.recipe)
    if args.backend:
        parallel = dataclasses.replace(parallel, backend=args.backend)
    if args.comm_dtype:
        parallel = dataclasses.replace(parallel, comm_dtype=args.comm_dtype)
    if args.attention != "native":
        check_quantized_attention(args.attention, gpu)
        parallel = dataclasses.replace(parallel, kernel=args.attention, native_steps=args.attention_native_steps)
    if args.emulate_link is not None:
        check_link(args.emulate_link, machines, serving)
        parallel = dataclasses.replace(parallel, emulate_link=args.emulate_link)
    guidance_scale = given(args.guidance_scale, spec.guidance_scale)
    check_guidance(args.model, args.guidance_scale, args.true_cfg_scale, args.cfg_parallel)
    cfg = cfg_degree(args.cfg_parallel, guided(spec, guidance_scale, args.true_cfg_scale))
    parallel = dataclasses.replace(parallel, cfg=cfg)
    branch_machines, branch_gpus = cfg_shape(machines, gpus_per_machine, cfg)
    if parallel.method == "auto":
        load_recipes(args.recipe)  # a missing recipe fails here, not at the first attention call
    else:
        resolve_layout(dataclasses.replace(parallel, machines=branch_machines, gpus_per_machine=branch_gpus, cfg=1),
                       world // cfg, spec.transformer["num_attention_heads"])
    tokens = spec.image_tokens(height, width, frames)
    if tokens < world:
        raise ValueError(f"{height}x{width} gives {tokens} image tokens, fewer than the {world} ranks; "
                         f"raise --height/--width or run on fewer processes")
    if args.max_memory is not None and not args.shard_weights:
        raise ValueError("--max-memory is the memory --shard-weights fits in: add --shard-weights or drop it")
    if args.streamed_blocks is not None and not args.shard_weights:
        raise ValueError("--streamed-blocks says how --shard-weights' streamed blocks run: add --shard-weights or "
                         "drop it")
    if args.max_memory is not None and args.max_memory <= 0:
        raise ValueError(f"--max-memory {args.max_memory:g}: give the GiB per GPU the run may take (> 0)")
    cuda_graph, graph_why = graph_choice(args, gpu)
    steps = given(args.steps, spec.steps)
    paths = getattr(args, "image", None) or []
    if serving and paths:
        raise ValueError("--image is for generate: a served edit sends its image with the request "
                         "(POST /v1/images/edits)")
    if not serving:
        check_images(args.model, len(paths))
    images = tuple(read_image(path, family=adapter(spec.family)) for path in paths)
    stack = parse_stack(args.cache, args.lora, args.quantize, family=spec.family, steps=steps, gpu=gpu)
    if stack.adapters and (args.compile or args.shard_weights):
        flag = "--compile" if args.compile else "--shard-weights"
        why = ("recompiles every block for each choice of adapters (its guards read their flags and weights)"
               if args.compile else "is not yet checked with the adapters' layers inside the sharded blocks")
        raise ValueError(f"{flag} with named LoRAs (--lora NAME=PATH) is not supported: it {why}; fuse them "
                         f"(--lora PATH) or drop {flag}")
    if gpu and args.shard_weights and world > 1 and real_size(args.model) and not args.weights:
        check_host_memory(args.model, height, width, frames, world, parallel, args.max_memory)
    job = Job(model=args.model, weights=args.weights, prompt=args.prompt, height=height, width=width, frames=frames,
              steps=steps, guidance_scale=guidance_scale, true_cfg_scale=args.true_cfg_scale,
              max_sequence_length=given(args.max_sequence_length, spec.max_sequence_length), seed=args.seed,
              dtype=args.dtype or ("bfloat16" if gpu else "float32"), parallel=parallel, world_size=world,
              gpu=gpu, output=args.output, vae_split=args.vae_split, cuda_graph=cuda_graph, graph_why=graph_why,
              shard_weights=args.shard_weights, max_memory=args.max_memory,
              streamed_blocks=args.streamed_blocks or "auto", stack=stack,
              weights_seed=args.weights_seed, deterministic=args.deterministic, images=images)
    check_memory(job)
    compiled, why = compile_choice(args, job, serving)
    if args.compile_cache is not None and not compiled:
        raise ValueError(f"--compile-cache is where compiled blocks are kept, and nothing compiles here ({why}): "
                         f"add --compile or drop --compile-cache")
    cache = str(Path(args.compile_cache or default_cache()).expanduser().resolve()) if compiled else None
    return dataclasses.replace(job, compile=compiled, compile_why=why, compile_cache=cache)


def available_host_gib() -> float | None:
    """This machine's available memory (Linux's MemAvailable), GiB; None where it is not known."""
    try:
        with open("/proc/meminfo") as f:
            line = next(x for x in f if x.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) / 2**20


def check_host_memory(model: str, height: int, width: int, frames: int, world: int, parallel: ParallelConfig,
                      max_memory: float | None, available: float | None = None, gpu_gib: float | None = None,
                      local: int | None = None) -> None:
    """--shard-weights with random weights: each rank of a machine makes the whole pipeline in host memory before
    sharding it, so a machine without that much memory would lose ranks to the out-of-memory killer mid start:
    refuse in one line first."""
    from ..models.memory import GIB, parked_gib

    available = available_host_gib() if available is None else available
    if available is None:
        return
    gpu_gib = gpu_gib or max_memory or torch.cuda.get_device_properties(0).total_memory / GIB
    local = local or int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or torch.cuda.device_count()  # a rank per GPU
    cfg = parallel.cfg if isinstance(parallel.cfg, int) else 1
    need = parked_gib(model, height, width, frames, world, local, gpu_gib, cfg=cfg)
    if need > available:
        raise ValueError(f"--shard-weights: {local} ranks of this machine each make {model}'s random weights in host "
                         f"memory before sharding them, about {need:.0f} GiB in all, and {available:.0f} GiB is "
                         f"available: run fewer ranks per machine (CUDA_VISIBLE_DEVICES, or launch's "
                         f"--nproc-per-node), load real weights (--weights), or free memory")


def check_memory(job: Job, available_gib: float | None = None) -> None:
    """A size whose generation cannot fit would start every rank, build, and fail on an allocation a while later:
    refuse in one line first, with the largest square that fits, by models/memory.py's estimate (`plan
    --memory`'s; whole weights, or sharded with every block streamed: the least a size can need). On GPUs each
    rank's peak beside the CUDA runtime within its card; on the CPU this machine's ranks' peaks within its
    available memory. Quantized weights are smaller than the estimate counts them: not checked."""
    from ..models.memory import GIB, RUNTIME_GIB, estimate, largest_size, pipeline_parts

    if job.stack.quantize is not None or (job.gpu and not torch.cuda.is_available()):  # no card here to ask
        return
    if job.gpu:
        ranks_here, runtime = 1, RUNTIME_GIB
        room = torch.cuda.get_device_properties(0).total_memory / GIB
    else:
        available = available_host_gib() if available_gib is None else available_gib
        if available is None:
            return
        ranks_here, runtime = int(os.environ.get("LOCAL_WORLD_SIZE", job.world_size)), 0.0
        room = available / ranks_here
    dtype, cfg = DTYPES[job.dtype], job.parallel.cfg if isinstance(job.parallel.cfg, int) else 1
    streamed = "gather" if job.streamed_blocks == "auto" else job.streamed_blocks
    shape = {"cfg": cfg, "sharded": job.shard_weights, "streamed": streamed}
    parts = pipeline_parts(job.model, dtype)
    peak = estimate(job.model, job.height, job.width, job.frames, job.world_size, parts=parts,
                    bytes_per_value=dtype.itemsize, **shape).peak + runtime
    if peak <= room:
        return
    pixels, _ = largest_size(job.model, job.world_size, room, frames=job.frames, dtype=dtype, runtime_gib=runtime,
                             **shape)
    side = math.isqrt(pixels)
    fits = (f"at most {side}x{side} fits" if side else
            f"no size fits (streamfusion plan --memory --model {job.model} says why)")
    need = (f"about {peak:.1f} GiB on each GPU, which has {room:.0f} GiB" if job.gpu else
            f"about {ranks_here * peak:.1f} GiB for its {ranks_here} CPU processes, and {ranks_here * room:.1f} GiB "
            f"is available")
    more = "; or add GPUs, or --shard-weights" if job.gpu and not job.shard_weights else ""
    raise ValueError(f"{job.width}x{job.height}: {job.model} needs {need} (models/memory.py's estimate): "
                     f"{fits}{more}")
