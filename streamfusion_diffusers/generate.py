"""`streamfusion generate`: run a Flux or CogVideoX pipeline sequence-parallel and write its output and run.json
(the options and their checks: job.py).

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
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import init_parallel, shutdown
from .job import DTYPES, Job, add_arguments, make_job
from .phases import PhaseTimer
from .spawn import run_local

logger = logging.getLogger(__name__)
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
    kwargs: dict[str, Any] = dict(prompt=job.prompt, height=job.height, width=job.width,
                                  num_inference_steps=job.steps, guidance_scale=job.guidance_scale,
                                  max_sequence_length=job.max_sequence_length,
                                  generator=torch.Generator("cpu").manual_seed(job.seed),
                                  output_type="pil" if rank == 0 else "pt" if job.vae_split else "latent")
    if job.spec.family == "cogvideox":
        kwargs["num_frames"] = job.frames
    if job.true_cfg_scale is not None:
        kwargs.update(true_cfg_scale=job.true_cfg_scale, negative_prompt="")
    built = time.perf_counter()
    phases = PhaseTimer(device)
    with torch.inference_mode():
        result = phases.call(pipe, **kwargs)
    finished = phases.now()
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
        "step_latency_s": phases.step_latencies, "phases_s": phases.seconds,
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


__all__ = ["Job", "add_arguments", "main", "make_job", "run_rank"]
