"""`streamfusion generate`: run a diffusers pipeline (Flux.1, Flux.2, Wan 2.2, Qwen-Image, CogVideoX)
sequence-parallel and write its output and run.json (the options and their checks: runtime/job.py; the models and
their pipelines: models/configs.py MODELS, models/pipelines/).

With no arguments: a tiny Flux pipeline (random weights) with method "auto" (the recipe entry for the shape and
cluster, else the cost model's choice), in one NCCL process per visible GPU or, with no GPU (or --cpu), in 4 gloo
processes on the CPU as 2 machines x 2; under torchrun, in the launcher's processes. A real-size `--model`
(flux-dev, cogvideox-5b, flux2-dev, wan2.2-ti2v-5b, wan2.2-t2v-a14b, qwen-image) builds the pipeline from its
real configs (random weights unless `--weights` names a hub id or local folder); without a GPU those are refused
unless --cpu asks for them. Everything is checked before any process starts or any model is built.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..core.join import launched
from ..runtime import output, worker
from ..runtime.arguments import DTYPES, add_arguments
from ..runtime.job import Job, make_job, real_size
from ..runtime.build import import_ahead
from ..runtime.record import one_time_text
from ..runtime.run import run_job
from ..runtime.startup import describe

logger = logging.getLogger(__name__)


def write_outputs(job: Job, answer: dict) -> dict:
    """The output files and run.json of the job's one generation; its record, with the files it wrote (and, from a
    model that makes sound, what the sound is and whether the mp4 holds it)."""
    record, audio = answer["records"][0], answer["audio"][0]
    record["outputs"] = output.write(answer["pixels"][0], job.spec.video, job.output, job.spec.fps, audio)
    if audio is not None:
        record["audio"] = {**output.sound(audio), "muxed": any(p.endswith(".mp4") for p in record["outputs"])}
    (Path(job.output) / "run.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def _stacked(value: Any) -> str:
    """One part of run.json's "stack" as the summary line says it (LoRAs as [NAME=]PATH:SCALE)."""
    if isinstance(value, list):
        return ", ".join(f"{lora['name'] + '=' if 'name' in lora else ''}{lora['path']}:{lora['scale']:g}"
                         for lora in value)
    return str(value)


def _memory_line(job: Job) -> str:
    """What a real-size model asks of the CPU: its parameters (counted on the meta device) per process."""
    from ..models.full import build_full_pipeline

    pipe = build_full_pipeline(job.model, dtype=DTYPES[job.dtype], device="meta")
    parts = [c for c in pipe.components.values() if isinstance(c, torch.nn.Module)]
    each = sum(p.numel() * p.element_size() for c in parts for p in c.parameters())
    return (f"streamfusion generate: {job.model} on the CPU in {job.world_size} processes needs about "
            f"{job.world_size * each / 2**30:.0f} GiB of memory ({each / 2**30:.0f} GiB of {job.dtype} weights each)")


def _around(record: dict, ran: float, wall: float) -> str:
    """Where the time beside the generation went: rank 0's start-up by stage, the ranks' teardown (what the ranks'
    run took beyond both), and the rest (this process's checks and the files written). Under a launcher this
    process is rank 0: its process start and imports came before the run."""
    started = sum(record["startup_s"].values())
    if launched():
        started -= record["startup_s"].get("process and imports", 0.0)
    stages = describe(record["startup_s"]) if record["startup_s"] else \
        f"processes, imports, the pipeline's build {record['build_s']:.2f} s"
    return (f"start-up: {stages}; teardown {max(0.0, ran - started - record['generate_s']):.1f} s; writing and "
            f"checks {wall - ran:.1f} s")


def main(args: argparse.Namespace) -> int:
    began = time.perf_counter()
    job = make_job(args)
    if real_size(job.model) and not job.gpu and not launched():
        print(_memory_line(job), file=sys.stderr)
    if os.environ.get("RANK", "0") == "0":  # under a launcher every rank runs main: rank 0 speaks
        graphs = (f", CUDA graphs {'on' if job.cuda_graph else 'off'} ({job.graph_why}), blocks "
                  f"{'compiled' if job.compile else 'eager'} ({job.compile_why})") if job.gpu else ""
        print(f"streamfusion generate: starting {job.model} ({job.weights or 'random weights'}) on {job.world_size} "
              f"{'GPU' if job.gpu else 'CPU'} processes as {job.parallel.machines} machines x "
              f"{job.parallel.gpus_per_machine}, method {job.parallel.label}"
              f"{graphs}"
              f"; start-up (processes, imports, the pipeline's build) comes first", flush=True)
    # no bound on the whole run: a rank that fails or dies ends it, and one that stalls makes its peers'
    # collectives fail after timeout_s
    ran = time.perf_counter()
    answer = run_job(worker.generate, job.world_size, job, gpu=job.gpu, timeout_s=job.parallel.timeout_s,
                     wait_s=math.inf, ahead=import_ahead if job.gpu else None)[0]
    ran = time.perf_counter() - ran  # the ranks' start-up, the generation and their teardown
    if answer is not None:  # rank 0's (under a launcher, the other ranks return None)
        record = write_outputs(job, answer)
        steps = record["step_latency_s"]
        once = one_time_text(record)
        pace = f"{1e3 * sum(steps):.1f} ms/step"
        if len(steps) > 1:
            pace = (f"{1e3 * statistics.median(steps[1:]):.1f} ms/step after the first ({steps[0]:.2f} s"
                    f"{'; one-time work: ' + once if once else ''})")
        cfg = f"cfg {record['cfg']} x " if record["cfg"] > 1 else ""
        wall = time.perf_counter() - began
        print(f"streamfusion generate: {record['model']} on {record['world_size']} ranks ({cfg}{record['layout']}, "
              f"{record['backend']}), {len(steps)} steps, {pace}; {record['generate_s']:.2f} s "
              f"generating, {wall - record['generate_s']:.2f} s around it ({_around(record, ran, wall)}), "
              f"{wall:.2f} s in all")
        print("phases: " + ", ".join(f"{name} {sec:.2f} s" for name, sec in record["phases_s"].items()))
        if record["stack"]:
            print("stack: " + "; ".join(f"{part} {_stacked(value)}" for part, value in record["stack"].items()))
        if job.parallel.method == "auto":
            print("method auto: " + "; ".join(sorted({a["why"] for a in record["attention"]})))
        print(f"wrote {', '.join(record['outputs'][:3])}{' ...' if len(record['outputs']) > 3 else ''} and "
              f"{Path(job.output) / 'run.json'}")
    return 0


__all__ = ["add_arguments", "main", "write_outputs"]
