"""What runs in each rank process of a parallel group: build the pipeline once, then one request at a time.

Every rank of the group receives the same request from the supervisor (groups.py) and runs the same pipeline
call, so each rank's collectives meet their peers'; the group's first rank returns the encoded result. A request
that runs past its deadline stops at a step boundary that every rank agrees on (a one-integer all-reduce over a
gloo side group at each step's end), so the ranks stay in step and the next request needs no rebuild; NCCL never
waits on Python for it.
"""
from __future__ import annotations

import io
import os
import signal
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..commands.generate import Prepared, call_kwargs, no_autograd, prepare, run_record
from ..commands.job import Job
from ..commands.phases import PhaseTimer
from ..commands.spawn import note
from .validation import FPS, Params

WARMUP_STEPS = 2  # the warm-up generation's steps: enough to choose the layout and make every lazy first call


@dataclass
class Served:
    """This rank's pipeline and the side group the deadline agreement runs over."""

    job: Job
    prepared: Prepared
    side: Any  # a gloo process group of the group's ranks (None on one rank)


# The pipeline this rank process serves: built once by `build`, used by every request, and gone with the process
# (a rank process serves one pipeline; the supervisor restarts the process to rebuild it).
_SERVED: Served | None = None


class _Late(Exception):
    """Every rank passed the request's deadline at the same step."""

    def __init__(self, step: int):
        self.step = step


def build(job: Job) -> dict | None:
    """Build and parallelize the job's pipeline on this rank, then warm it up with one short generation (the
    layout is chosen and every lazy first call made before the first request); rank 0 says what ran."""
    global _SERVED
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole terminal: the server drains, not ranks
    prepared = prepare(job)
    prepared.pipe.set_progress_bar_config(disable=True)  # a bar per request would flood the server's log
    side = dist.new_group(backend="gloo") if dist.get_world_size() > 1 else None
    _SERVED = Served(job, prepared, side)
    started = time.perf_counter()
    warm = Params(prompt=job.prompt, negative_prompt=None, height=job.height, width=job.width, frames=job.frames,
                  steps=min(job.steps, WARMUP_STEPS), seed=job.seed, guidance_scale=job.guidance_scale)
    result = _generate(_SERVED, warm, 0, deadline=float("inf"))
    if dist.get_rank() != 0:
        return None
    return {"build_s": prepared.build_s, "warmup_s": time.perf_counter() - started, "record": result[1],
            "pid": os.getpid()}


def _step_end(served: Served, deadline: float, steps: int):
    """The step callback: agree on the deadline, then note the progress (rank 0)."""
    def step_end(pipe: Any, step: int, timestep: Any, kwargs: dict) -> dict:
        late = torch.tensor([int(time.monotonic() > deadline)], dtype=torch.int32)
        if served.side is not None:
            dist.all_reduce(late, op=dist.ReduceOp.MAX, group=served.side)
        if late.item():
            raise _Late(step + 1)
        if dist.get_rank() == 0:
            note((step + 1, steps))
        return kwargs

    return step_end


def _generate(served: Served, params: Params, index: int, deadline: float) -> tuple[Any, dict | None]:
    """Image or video `index` of the request: (the pipeline's result, rank 0's record, else None)."""
    job = params.job(served.job, index)
    kwargs = call_kwargs(job, served.prepared)
    if params.negative_prompt is not None:
        kwargs["negative_prompt"] = params.negative_prompt
    if job.gpu:  # the record's peak memory is this request's
        torch.cuda.reset_peak_memory_stats(served.prepared.device)
    phases = PhaseTimer(served.prepared.device)
    started = time.perf_counter()
    pipe = served.prepared.pipe
    try:
        with no_autograd(job):
            result = phases.call(pipe, callback_on_step_end=_step_end(served, deadline, job.steps), **kwargs)
    except _Late:  # stopped mid-call: reset what a finished call resets (a cache's state), as the pipeline would
        pipe.maybe_free_model_hooks()
        raise
    seconds = phases.now() - started
    if dist.get_rank() != 0:
        return None, None
    return result, run_record(job, served.prepared, result, phases, seconds, build_s=0.0)


def _png(image: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")  # what generate's image.png holds
    return buffer.getvalue()


def _mp4(frames: list) -> bytes:
    from diffusers.utils import export_to_video

    with tempfile.TemporaryDirectory() as folder:
        path = export_to_video(frames, os.path.join(folder, "video.mp4"), fps=FPS)
        with open(path, "rb") as f:
            return f.read()


def serve(params: Params, deadline_s: float) -> dict | None:
    """One request on every rank: its n images (seed, seed + 1, ...) or its video. Rank 0 answers
    {"outputs": [png or mp4 bytes], "records": [...]}, or {"late": step} when the deadline stopped it."""
    assert _SERVED is not None, "serve before build"
    deadline = time.monotonic() + deadline_s
    outputs, records = [], []
    try:
        for index in range(params.n):
            result, record = _generate(_SERVED, params, index, deadline)
            if record is not None:
                video = _SERVED.job.spec.video
                outputs.append(_mp4(result.frames[0]) if video else _png(result.images[0]))
                records.append(record)
    except _Late as late:
        return {"late": late.step, "steps": params.steps} if dist.get_rank() == 0 else None
    return {"outputs": outputs, "records": records} if dist.get_rank() == 0 else None


__all__ = ["build", "serve"]
