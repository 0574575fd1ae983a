"""`streamfusion generate`: run a Flux or CogVideoX pipeline sequence-parallel and write its output and run.json.

With no arguments: a tiny Flux pipeline (random weights) on the CPU, in 4 gloo processes as 2 machines x 2,
with method "auto" (the recipe entry for the shape and cluster, else the cost model's choice). `--model flux-dev`
or `--model cogvideox-5b` builds the real-size transformer from its real config (random weights unless `--weights` names a hub id or local folder); launch those under
torchrun, one GPU per process. The layout is checked before any process starts or any model is built.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import ParallelConfig, init_parallel, shutdown
from .config import METHODS, cfg_shape, resolve_layout
from .models import MODELS, ModelSpec
from .phases import PhaseTimer
from .recipes import load_recipes
from .spawn import run_local

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_PROMPT = "a photo of a red cat on a quiet street at sunset"
SPAWN_SHAPE = (2, 2)  # machines x GPUs (processes) per machine when not under torchrun


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny-flux",
                        help="tiny-* build small random models for the CPU; flux-dev / cogvideox-5b are real size")
    parser.add_argument("--weights", default=None,
                        help="hub id or local folder of a diffusers pipeline (default: random weights)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--height", type=int, default=None, help="pixels (default: the model's)")
    parser.add_argument("--width", type=int, default=None, help="pixels (default: the model's)")
    parser.add_argument("--frames", type=int, default=None, help="video frames, CogVideoX only (default: the model's)")
    parser.add_argument("--steps", type=int, default=None, help="denoising steps (default: the model's)")
    parser.add_argument("--guidance-scale", type=float, default=None)
    parser.add_argument("--max-sequence-length", type=int, default=None, help="text tokens (default: the model's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--method", choices=METHODS + ("auto",), default="auto",
                        help="default auto: the layout of the recipe entry for this shape and cluster (see --recipe), "
                             "else the cost model's fastest; chosen at the first attention call and logged")
    parser.add_argument("--ulysses", type=int, default=None, help="Ulysses degree U (default: from the heads)")
    parser.add_argument("--ring", type=int, default=None, help="Ring degree R (default: P / U)")
    parser.add_argument("--torus", type=int, default=None, help="Torus degree T (torus method only)")
    parser.add_argument("--machines", type=int, default=None,
                        help=f"machines N (default {SPAWN_SHAPE[0]} when spawning, the node count under torchrun)")
    parser.add_argument("--gpus-per-machine", type=int, default=None,
                        help=f"processes per machine M (default {SPAWN_SHAPE[1]} when spawning, "
                             f"LOCAL_WORLD_SIZE under torchrun)")
    parser.add_argument("--backend", choices=("torch", "nvshmem"), default=None,
                        help="transport: torch (NCCL on GPUs, gloo on the CPU) or nvshmem (one-sided, GPUs; falls back "
                             "to torch with one warning where it cannot run); default torch")
    parser.add_argument("--recipe", default=None,
                        help="where --method auto looks: a packaged recipe (flux-dev), a YAML path or a folder of "
                             "them (streamfusion tune --out); default: the packaged recipes")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default float32 on the CPU, bfloat16 on GPUs")
    parser.add_argument("--output", default="streamfusion-output", help="folder for the image/video and run.json")
    parser.add_argument("--cpu", action="store_true", help="gloo on the CPU even where GPUs exist")
    parser.add_argument("--cfg-parallel", nargs="?", const="2", choices=("1", "2", "auto"), default="1",
                        help="compute the two classifier-free-guidance branches at once, each on half of the ranks "
                             "(one branch per half of the machines when the machine count is even); "
                             "'auto': when guidance is on")
    parser.add_argument("--true-cfg-scale", type=float, default=None,
                        help="Flux: true classifier-free guidance with an empty negative prompt when > 1")
    parser.add_argument("--comm-dtype", choices=("fp8", "int8"), default=None,
                        help="send the attention chunks that cross machines as 1-byte values with per-token-and-head "
                             "scales (fp8: float8_e4m3fn; int8); intra-machine traffic is untouched")
    parser.add_argument("--vae-split", action=argparse.BooleanOptionalAction, default=True,
                        help="split the VAE decode's tiles over the ranks (default; diffusers' tiled decode, "
                             "gathered); --no-vae-split decodes untiled on rank 0")
    parser.add_argument("--cuda-graph", action="store_true",
                        help="capture the whole transformer forward in a CUDA graph once, replay it every step (GPU)")


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
    guidance_scale: float
    true_cfg_scale: float | None
    max_sequence_length: int
    seed: int
    dtype: str
    parallel: ParallelConfig
    world_size: int
    gpu: bool
    output: str
    vae_split: bool = True
    cuda_graph: bool = False

    @property
    def spec(self) -> ModelSpec:
        return MODELS[self.model]


def image_tokens(spec: ModelSpec, height: int, width: int, frames: int) -> int:
    """Image/video tokens the transformer sees: latent size / patch size, frames compressed 4x for CogVideoX."""
    cfg = spec.transformer
    if spec.family == "flux":
        return (height // spec.vae_scale // 2) * (width // spec.vae_scale // 2)
    p, p_t = cfg["patch_size"], cfg.get("patch_size_t") or 1
    latent_frames = (frames - 1) // cfg["temporal_compression_ratio"] + 1
    return (latent_frames // p_t) * (height // spec.vae_scale // p) * (width // spec.vae_scale // p)


def guided(spec: ModelSpec, guidance_scale: float, true_cfg_scale: float | None) -> bool:
    """Whether the pipeline runs two guidance branches: CogVideoX with guidance > 1, Flux with true CFG > 1
    (Flux's guidance_scale is distilled guidance, one branch)."""
    if spec.family == "flux":
        return true_cfg_scale is not None and true_cfg_scale > 1
    return guidance_scale > 1


def cfg_degree(option: str, is_guided: bool) -> int:
    """--cfg-parallel as a CFG degree: 'auto' takes 2 when guidance is on; 2 without guidance is an error."""
    if option == "auto":
        return 2 if is_guided else 1
    if option == "2" and not is_guided:
        raise ValueError("--cfg-parallel needs two guidance branches: CogVideoX with --guidance-scale > 1, Flux with "
                         "--true-cfg-scale > 1; or drop --cfg-parallel")
    return int(option)


def make_job(args: argparse.Namespace) -> Job:
    """Resolve defaults and check the layout against the model, before any process starts."""
    if importlib.util.find_spec("diffusers") is None:
        raise ValueError("streamfusion generate needs diffusers: pip install 'streamfusion-diffusers[diffusers]'")
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if under_torchrun:
        world = int(os.environ["WORLD_SIZE"])
        per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        machines = args.machines or max(world // per_machine, 1)
        gpus_per_machine = args.gpus_per_machine or world // machines
        gpu = torch.cuda.is_available() and not args.cpu
    else:
        machines = args.machines or SPAWN_SHAPE[0]
        gpus_per_machine = args.gpus_per_machine or SPAWN_SHAPE[1]
        world = machines * gpus_per_machine
        gpu = torch.cuda.is_available() and torch.cuda.device_count() >= world and not args.cpu
    spec = MODELS[args.model]
    height, width = args.height or spec.height, args.width or spec.width
    frames = args.frames or spec.frames
    if args.recipe and args.method != "auto":
        raise ValueError(f"--recipe is what --method auto reads; drop --method {args.method} or --recipe")
    parallel = ParallelConfig(machines=machines, gpus_per_machine=gpus_per_machine, method=args.method,
                              ulysses=args.ulysses, ring=args.ring, torus=args.torus, recipe=args.recipe)
    if args.backend:
        parallel = dataclasses.replace(parallel, backend=args.backend)
    if args.comm_dtype:
        parallel = dataclasses.replace(parallel, comm_dtype=args.comm_dtype)
    guidance_scale = args.guidance_scale or spec.guidance_scale
    cfg = cfg_degree(args.cfg_parallel, guided(spec, guidance_scale, args.true_cfg_scale))
    parallel = dataclasses.replace(parallel, cfg=cfg)
    branch_machines, branch_gpus = cfg_shape(machines, gpus_per_machine, cfg)
    if parallel.method == "auto":
        load_recipes(args.recipe)  # a missing recipe fails here, not at the first attention call
    else:
        resolve_layout(dataclasses.replace(parallel, machines=branch_machines, gpus_per_machine=branch_gpus, cfg=1),
                       world // cfg, spec.transformer["num_attention_heads"])
    tokens = image_tokens(spec, height, width, frames)
    if tokens < world:
        raise ValueError(f"{height}x{width} gives {tokens} image tokens, fewer than the {world} ranks; "
                         f"raise --height/--width or run on fewer processes")
    if args.cuda_graph and not gpu:
        from .graphs import NO_GPU
        raise ValueError(NO_GPU)
    return Job(model=args.model, weights=args.weights, prompt=args.prompt, height=height, width=width, frames=frames,
               steps=args.steps or spec.steps, guidance_scale=guidance_scale, true_cfg_scale=args.true_cfg_scale,
               max_sequence_length=args.max_sequence_length or spec.max_sequence_length, seed=args.seed,
               dtype=args.dtype or ("bfloat16" if gpu else "float32"), parallel=parallel, world_size=world,
               gpu=gpu, output=args.output, vae_split=args.vae_split, cuda_graph=args.cuda_graph)


class StepTimer:
    """Per-step latency: from the first transformer call to each step's end, then from step end to step end."""

    def __init__(self, device: torch.device):
        self.device = device
        self.marks: list[float] = []

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def start(self, *_: Any) -> None:
        if not self.marks:
            self.marks.append(self.now())

    def step_end(self, _pipe: Any, _step: int, _timestep: Any, callback_kwargs: dict) -> dict:
        self.marks.append(self.now())
        return callback_kwargs

    @property
    def latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def _write_output(job: Job, result: Any) -> list[str]:
    out = Path(job.output)
    out.mkdir(parents=True, exist_ok=True)
    if job.spec.family == "flux":
        path = out / "image.png"
        result.images[0].save(path)
        return [str(path)]
    frames = result.frames[0]
    if importlib.util.find_spec("imageio_ffmpeg") is not None:
        from diffusers.utils import export_to_video

        return [export_to_video(frames, str(out / "video.mp4"), fps=8)]
    logger.warning("no video encoder installed (pip install imageio imageio-ffmpeg): writing the frames as PNGs")
    (out / "frames").mkdir(exist_ok=True)
    paths = [out / "frames" / f"{i:03d}.png" for i in range(len(frames))]
    for frame, path in zip(frames, paths):
        frame.save(path)
    return [str(p) for p in paths]


def run_rank(job: Job) -> dict | None:
    """One rank's share of the job; rank 0 decodes, writes the output and returns the run record."""
    from .models.build import build_pipeline, load_pipeline  # diffusers is an extra: imported only to run
    from .models.full import build_full_pipeline
    from .parallelize import parallelize

    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if job.gpu else torch.device("cpu")
    dtype = DTYPES[job.dtype]
    ctx = init_parallel(job.parallel)
    started = time.perf_counter()
    if job.weights:
        pipe = load_pipeline(job.model, job.weights, dtype=dtype, device=device)
    else:
        # real-size models get real-size text encoders and VAE too, so the phases are the ones a user waits for
        build = build_pipeline if job.model.startswith("tiny-") else build_full_pipeline
        pipe = build(job.model, seed=job.seed, dtype=dtype, device=device)
    transformer = parallelize(pipe, ctx, vae=job.vae_split, cuda_graph=job.cuda_graph)
    pipe.set_progress_bar_config(disable=rank != 0, desc=f"{job.model} {job.parallel.label}")
    timer = StepTimer(device)
    transformer.register_forward_pre_hook(timer.start)
    kwargs: dict[str, Any] = dict(prompt=job.prompt, height=job.height, width=job.width,
                                  num_inference_steps=job.steps, guidance_scale=job.guidance_scale,
                                  max_sequence_length=job.max_sequence_length,
                                  generator=torch.Generator("cpu").manual_seed(job.seed),
                                  callback_on_step_end=timer.step_end,
                                  output_type="pil" if rank == 0 else "pt" if job.vae_split else "latent")
    if job.spec.family == "cogvideox":
        kwargs["num_frames"] = job.frames
    if job.true_cfg_scale is not None:
        kwargs.update(true_cfg_scale=job.true_cfg_scale, negative_prompt="")
    built = time.perf_counter()
    phases = PhaseTimer(device)
    with torch.inference_mode():
        result = phases.call(pipe, **kwargs)
    finished = timer.now()
    if rank != 0:
        return None
    record = {
        "model": job.model, "weights": job.weights or "random", "prompt": job.prompt,
        "height": job.height, "width": job.width, "frames": job.frames if job.spec.family == "cogvideox" else None,
        "steps": job.steps, "guidance_scale": job.guidance_scale, "seed": job.seed, "dtype": job.dtype,
        "device": "cuda" if job.gpu else "cpu", "world_size": job.world_size,
        "config": dataclasses.asdict(job.parallel), "vae_split": job.vae_split,
        "cuda_graph": job.cuda_graph,
        "layout": str(ctx.layout(transformer.config.num_attention_heads)), "cfg": ctx.cfg.degree,
        "layout_choice": sorted({c.why for c in ctx.chosen.values()}) or None,  # method auto: why
        "step_latency_s": timer.latencies, "phases_s": phases.seconds,
        "generate_s": finished - built, "build_s": built - started,
        "total_s": finished - started,
    }
    record["outputs"] = _write_output(job, result)
    (Path(job.output) / "run.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def _join_torchrun(gpu: bool) -> None:
    if dist.is_initialized():
        return
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if gpu else "gloo", timeout=datetime.timedelta(seconds=600))


def main(args: argparse.Namespace) -> int:
    job = make_job(args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _join_torchrun(job.gpu)
        record = run_rank(job)
        shutdown()
    else:
        record = run_local(run_rank, job.world_size, job, backend="nccl" if job.gpu else "gloo", timeout_s=3600)[0]
    if record is not None:
        steps = record["step_latency_s"]
        mean_ms = 1e3 * sum(steps) / max(len(steps), 1)
        cfg = f"cfg {record['cfg']} x " if record["cfg"] > 1 else ""
        print(f"streamfusion generate: {record['model']} on {record['world_size']} ranks ({cfg}{record['layout']}), "
              f"{len(steps)} steps, {mean_ms:.1f} ms/step, {record['total_s']:.2f} s in all")
        print("phases: " + ", ".join(f"{name} {sec:.2f} s" for name, sec in record["phases_s"].items()))
        print(f"wrote {', '.join(record['outputs'][:3])}{' ...' if len(record['outputs']) > 3 else ''} and "
              f"{Path(job.output) / 'run.json'}")
    return 0
