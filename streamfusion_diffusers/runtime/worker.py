"""What runs in each rank process of a job: build the pipeline once, then one request at a time.

Every rank of the group receives the same request and runs the same pipeline call, so each rank's collectives
meet their peers'; the group's first rank returns the pixels and what ran (the front encodes them). A request
that runs past its deadline stops at a step boundary that every rank agrees on (a one-integer all-reduce over a
gloo side group at each step's end), so the ranks stay in step and the next request needs no rebuild; NCCL never
waits on Python for it. `generate` is one request to such a job, `serve` many.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .build import Prepared, call_kwargs, no_autograd, prepare, run_record
from .job import Job
from .phases import PhaseTimer
from .pool import note
from .request import Request

WARMUP_STEPS = 2  # the warm-up generation's steps: the layout chosen and every lazy first call made at the first,
# the default size's CUDA graph captured at the second


@dataclass
class Served:
    """This rank's pipeline and the side group the step agreement runs over."""

    job: Job
    prepared: Prepared
    side: Any  # a gloo process group of the group's ranks (None on one rank, and for one generation)
    serving: bool  # many requests (graphs captured for every shape) or one generation (where a capture pays)


# The pipeline this rank process serves: built once by `build`, used by every request, and gone with the process
# (a rank process serves one pipeline; the supervisor restarts the process to rebuild it).
_SERVED: Served | None = None


class Late(Exception):
    """Every rank passed the request's deadline at the same step."""

    def __init__(self, step: int):
        self.step = step


def build(job: Job, serving: bool = True) -> dict | None:
    """Build and parallelize the job's pipeline on this rank; to serve, warm it up with one short generation
    so that the layout is chosen and every lazy first call made before the first request. Rank 0 says what ran."""
    global _SERVED
    if serving:  # Ctrl-C reaches the whole terminal: the server drains, not its ranks
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    prepared = prepare(job)
    if serving:
        prepared.pipe.set_progress_bar_config(disable=True)  # a bar per request would flood the server's log
    side = dist.new_group(backend="gloo") if serving and dist.get_world_size() > 1 else None
    _SERVED = Served(job, prepared, side, serving)
    started = time.perf_counter()
    record = None
    if serving:
        warm = Request(prompt=job.prompt, negative_prompt=None, height=job.height, width=job.width,
                       frames=job.frames, steps=min(job.steps, WARMUP_STEPS), seed=job.seed,
                       guidance_scale=job.guidance_scale)
        record = _generate(_SERVED, warm, 0, deadline=float("inf"))[1]
    if dist.get_rank() != 0:
        return None
    return {"build_s": prepared.build_s, "warmup_s": time.perf_counter() - started, "record": record,
            "pid": os.getpid()}


def _step_end(served: Served, deadline: float, steps: int):
    """The step callback: agree on the deadline, then note the progress (rank 0)."""
    def step_end(pipe: Any, step: int, timestep: Any, kwargs: dict) -> dict:
        late = torch.tensor([int(time.monotonic() > deadline)], dtype=torch.int32)
        if served.side is not None:
            dist.all_reduce(late, op=dist.ReduceOp.MAX, group=served.side)
        if late.item():
            raise Late(step + 1)
        if dist.get_rank() == 0:
            note((step + 1, steps))
        return kwargs

    return step_end


def _generate(served: Served, request: Request, index: int, deadline: float,
              build_s: float = 0.0) -> tuple[Any, dict | None]:
    """Generation `index` of the request: (the pipeline's result, rank 0's record, else None); `build_s`: the
    build's share of the record's total (the first request of a one-request job)."""
    job = request.job(served.job, index)
    kwargs = call_kwargs(job, served.prepared)
    if request.negative_prompt is not None:
        kwargs["negative_prompt"] = request.negative_prompt
    if job.gpu:  # the record's peak memory is this request's
        torch.cuda.reset_peak_memory_stats(served.prepared.device)
    phases = PhaseTimer(served.prepared.device)
    started = time.perf_counter()
    pipe = served.prepared.pipe
    if job.cuda_graph:
        from ..diffusers.graphs import set_horizon  # diffusers is an extra: imported only to run

        set_horizon(pipe, None if served.serving else job.steps)
    try:
        with no_autograd(job):
            result = phases.call(pipe, callback_on_step_end=_step_end(served, deadline, job.steps), **kwargs)
    except Late:  # stopped mid-call: reset what a finished call resets (a cache's state), as the pipeline would
        pipe.maybe_free_model_hooks()
        raise
    seconds = phases.now() - started
    if dist.get_rank() != 0:
        return None, None
    return result, run_record(job, served.prepared, result, phases, seconds, build_s=build_s)


def run(request: Request, deadline_s: float = float("inf"), build_s: float = 0.0) -> dict | None:
    """One request on every rank: its n generations (seed, seed + 1, ...). Rank 0 answers {"pixels": [a PIL
    image, or a video's PIL frames, each], "records": [...]}, or {"late": step} when the deadline stopped it."""
    assert _SERVED is not None, "run before build"
    deadline = time.monotonic() + deadline_s
    pixels, records = [], []
    try:
        for index in range(request.n):
            result, record = _generate(_SERVED, request, index, deadline, build_s)
            if record is not None:
                pixels.append(result.frames[0] if _SERVED.job.spec.video else result.images[0])
                records.append(record)
    except Late as late:
        return {"late": late.step, "steps": request.steps} if dist.get_rank() == 0 else None
    return {"pixels": pixels, "records": records} if dist.get_rank() == 0 else None


def generate(job: Job) -> dict | None:
    """The job's own generation, as one request: what `generate` runs on every rank."""
    build(job, serving=False)
    assert _SERVED is not None
    return run(Request.of(job), build_s=_SERVED.prepared.build_s)


__all__ = ["Late", "build", "generate", "run"]
