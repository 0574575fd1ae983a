"""What runs in each rank process of a job: build the pipeline once, then one batch of requests at a time.

Every rank of the group receives the same batch and runs the same pipeline call, so each rank's collectives
meet their peers'; the group's first rank returns the pixels and what ran (the front encodes them). A batch stops
early at a step boundary every rank agrees on, when it runs past its deadline or the front cancels it (pool.py's
cancel value): a one-integer all-reduce over a gloo side group at each step's end, so the ranks stay in step and
the next batch needs no rebuild; NCCL never waits on Python for it. A rank whose call runs out of GPU memory
frees its cache and joins that agreement once more saying so (matching its peers' next step end, or their
agreement after the call), so every rank leaves the call together and the group serves the next batch as it
is. Rank 0 notes each step (progress.py's StepNote: the batch's request ids, steps done, steps, seconds, and
the previews its requests asked for at that step). `generate` is one request to such a job, `serve` many.
"""
from __future__ import annotations

import gc
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from . import images
from .build import Prepared, call_kwargs, no_autograd, prepare
from .record import crossed, crossed_since, run_record
from .output import to_pil, wav
from ..attention.faults import EXACT, OutOfMemoryAt
from ..core.one_time import spent, spent_since
from ..models.pipelines import family_of
from .job import Job
from .phases import PhaseTimer
from .batch import call_plan
from .rank import cancelled, note
from .progress import PREVIEW_FAMILIES, LatentToRgb, StepNote, latent_grid, preview_steps
from .request import Request

WARMUP_STEPS = 2  # the warm-up generation's steps: the layout chosen and every lazy first call made at the first,
# each size's CUDA graph captured at the second


@dataclass
class Served:
    """This rank's pipeline and the side group the step agreement runs over."""

    job: Job
    prepared: Prepared
    side: Any  # a gloo process group of the group's ranks (None on one rank, and for one generation)
    serving: bool  # many requests (graphs captured for every shape) or one generation (where a capture pays)
    lora: tuple = ()  # the named adapters on now, with their weights (all off after the build)
    to_rgb: LatentToRgb | None = None  # rank 0's latent-to-RGB map for previews, fitted at the warm-up


def switch_adapters(served: Served, choice: tuple) -> float:
    """Turn on the named adapters `choice` (every rank runs the same batch, so every rank switches alike, before
    the same call; no collective); the seconds it took (0 when they are on already). With CUDA graphs, each choice
    has graphs of its own: a graph replays the adapter flags and scaling it was captured with."""
    if served.job.cuda_graph:
        from ..diffusers.graphs import set_variant  # diffusers is an extra: imported only to run

        set_variant(served.prepared.pipe, choice)
    if choice == served.lora:
        return 0.0
    from ..diffusers.stack.lora import use_adapters

    started = time.perf_counter()
    use_adapters(served.prepared.pipe, choice)
    served.lora = choice
    return time.perf_counter() - started


# The pipeline this rank process serves: built once by `build`, used by every request, and gone with the process
# (a rank process serves one pipeline; the supervisor restarts the process to rebuild it).
_SERVED: Served | None = None


GO, LATE, CANCELLED, OUT_OF_MEMORY = 0, 1, 2, 3  # what a rank says at a step's end; the ranks take the largest
WHY = {LATE: "late", CANCELLED: "cancelled", OUT_OF_MEMORY: "out_of_memory"}
# tests: the group's last rank runs out of memory at this step of every call (read once, at the build)
OOM_AT_STEP_ENV = "STREAMFUSION_TEST_OOM_AT_STEP"


class Stopped(Exception):
    """Every rank stopped the call at the same step: past its deadline, cancelled, or out of memory on a rank."""

    def __init__(self, why: str, step: int):
        self.why, self.step = why, step


def build(job: Job, serving: bool = True) -> dict | None:
    """Build and parallelize the job's pipeline on this rank (to serve: `warm_up` next). Rank 0 says how long."""
    global _SERVED
    if serving:  # Ctrl-C reaches the whole terminal: the server drains, not its ranks
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    prepared = prepare(job)
    oom_at = os.environ.get(OOM_AT_STEP_ENV)
    if oom_at and dist.get_rank() == dist.get_world_size() - 1:
        prepared.ctx.fault = OutOfMemoryAt(int(oom_at))
    # what is built by now (the pipeline, the libraries' import-time objects) lives as long as the rank: frozen,
    # the cyclic collector's full passes no longer walk it all in the middle of a step
    gc.collect()
    gc.freeze()
    if serving:
        prepared.pipe.set_progress_bar_config(disable=True)  # a bar per request would flood the server's log
    side = dist.new_group(backend="gloo") if serving and dist.get_world_size() > 1 else None
    _SERVED = Served(job, prepared, side, serving)
    return {"build_s": prepared.build_s, "startup_s": prepared.startup_s, "pid": os.getpid()} \
        if dist.get_rank() == 0 else None


def warm_up(shapes: tuple[tuple[int, int, int], ...]) -> dict | None:
    """Short generations before the first request, one per shape (width, height, images in the call: serve's
    warm-up plan, serve/warm.py), so that the layout is chosen, every lazy first call made, the blocks compiled
    for the shapes requests bring and each size's CUDA graph captured. Rank 0 says how long, and what the first
    ran."""
    assert _SERVED is not None, "warm_up before build"
    job = _SERVED.job
    started = time.perf_counter()
    previews = family_of(job.model).name in PREVIEW_FAMILIES
    first = None
    for width, height, n in shapes:
        warm = Request(prompt=job.prompt, negative_prompt=None, height=height, width=width,
                       frames=job.frames, steps=min(job.steps, WARMUP_STEPS), seed=job.seed,
                       guidance_scale=job.guidance_scale, n=n, images=job.images or _warm_images(job, width, height))
        records = _generate(_SERVED, [warm], deadline=float("inf"), fit_map=previews and first is None)[2]
        first = first or records
    if dist.get_rank() != 0:
        return None
    return {"warmup_s": time.perf_counter() - started, "record": first[0] if first else None}


class Agreement:
    """Where the ranks of a call agree on stopping: at each step's end, and once after the call (so that a rank
    that left the call early, out of memory, always meets its peers' next agreement)."""

    def __init__(self, served: Served, deadline: float, batch: list[Request], job: Job, order: list[int],
                 keep_latents: bool = False):
        self.served, self.deadline, self.steps = served, deadline, job.steps
        self.height, self.width = job.height, job.width
        self.ids = [r.id for r in batch]
        self.step = 0  # steps done
        self.started = time.perf_counter()
        self.keep_latents = keep_latents  # rank 0 keeps the latest step's latents (the warm-up's map is fitted on them)
        self.latents: Any = None
        self.previews = self._previews(batch, order) if dist.get_rank() == 0 else {}
        self.fault = served.prepared.ctx.fault or EXACT  # the serve tests' out of memory (attention/faults.py)
        served.prepared.ctx.attention_step(0, self.steps)  # a quantized kernel's first steps attend natively

    def agree(self, said: int) -> int:
        """The largest of what every rank says."""
        flag = torch.tensor([said], dtype=torch.int32)
        if self.served.side is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.served.side)
        return int(flag.item())

    def step_end(self, pipe: Any, step: int, timestep: Any, kwargs: dict) -> dict:
        """The pipeline's step callback: agree on stopping (deadline or cancel), then note the progress (rank 0)."""
        self.step = step + 1
        self.fault.step_end(self.step)
        stop = self.agree(CANCELLED if cancelled() else LATE if time.monotonic() > self.deadline else GO)
        if stop:
            raise Stopped(WHY[stop], self.step)
        self.served.prepared.ctx.attention_step(self.step, self.steps)
        if dist.get_rank() == 0:
            if self.keep_latents:
                self.latents = kwargs["latents"]
            drawn = {rid: self.draw(pipe, kwargs["latents"][at]) for rid, (at, steps) in self.previews.items()
                     if self.step in steps}
            note(StepNote(self.ids, self.step, self.steps, time.perf_counter() - self.started, drawn))
        return kwargs

    def _previews(self, batch: list[Request], order: list[int]) -> dict[str, tuple[int, set[int]]]:
        """For each request that asked for previews: its first image's place in the call, and the steps to draw."""
        if self.served.to_rgb is None:
            return {}
        first, found = 0, {}
        for request in batch:
            if request.partial_images:
                found[request.id] = (order.index(first), preview_steps(self.steps, request.partial_images))
            first += request.n
        return found

    def draw(self, pipe: Any, latents: Any) -> Any:
        """One image's preview from its packed latents (rank 0)."""
        assert self.served.to_rgb is not None
        return self.served.to_rgb(latent_grid(pipe, latents[None], self.height, self.width)[0])

    def out_of_memory(self) -> Stopped:
        """This rank ran out of memory: free the cache, tell the peers (at their next agreement) and stop."""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.agree(OUT_OF_MEMORY)
        return Stopped(WHY[OUT_OF_MEMORY], self.step)

    def after(self) -> None:
        """The call ended on this rank: stop with the others when a peer ran out of memory meanwhile."""
        if self.agree(GO) == OUT_OF_MEMORY:
            raise Stopped(WHY[OUT_OF_MEMORY], self.step)


def _warm_images(job: Job, width: int, height: int) -> tuple[bytes, ...]:
    """A blank input image of the warm-up's size where every call edits one, else none."""
    return (images.blank(width, height),) if family_of(job.model).needs_image else ()


def _generate(served: Served, batch: list[Request], deadline: float, build_s: float = 0.0,
              fit_map: bool = False) -> tuple[list | None, list | None, list[dict] | None]:
    """The batch's images in one pipeline call: (each image's pixels, each one's sound as WAV bytes or None,
    each one's record) in request order on rank 0, else (None, None, None); `build_s`: the build's share of the
    records' total (a one-request job).
    `fit_map`: rank 0 fits the previews' latent-to-RGB map on this call's first image (the warm-up)."""
    job = batch[0].job(served.job)  # the call's shape: every request of a batch shares it
    plan = call_plan(batch)
    kwargs = call_kwargs(job, served.prepared)
    call = plan.kwargs(job.spec.video)
    if "prompt_embeds" in kwargs:  # the job's one prompt, encoded before the transformer was built
        call.pop("prompt")
    kwargs.update(call)
    if batch[0].negative_prompt is not None:
        kwargs["negative_prompt"] = batch[0].negative_prompt
    if isinstance(kwargs.get("negative_prompt"), str) and isinstance(kwargs.get("prompt"), list):
        kwargs["negative_prompt"] = [kwargs["negative_prompt"]] * len(kwargs["prompt"])  # one per prompt
    if job.gpu:  # the record's peak memory is this call's
        torch.cuda.reset_peak_memory_stats(served.prepared.device)
    phases = PhaseTimer(served.prepared.device)
    started = time.perf_counter()
    pipe = served.prepared.pipe
    if batch[0].images:  # every request of the batch has the same (runtime/request.py's shape)
        family = family_of(job.model)
        pipe = family.image_pipeline(job.spec, pipe)
        kwargs.update(family.image_kwargs(job.spec, [images.decode(data) for data in batch[0].images]))
    if job.cuda_graph:
        from ..diffusers.graphs import set_horizon  # diffusers is an extra: imported only to run

        set_horizon(pipe, None if served.serving else job.steps)
    switch_s = switch_adapters(served, batch[0].lora) if served.job.stack.adapters else None
    agreement = Agreement(served, deadline, batch, job, plan.order, keep_latents=fit_map)
    before, first = crossed(served.prepared.ctx), spent()
    try:
        try:
            with no_autograd(job):
                result = phases.call(pipe, callback_on_step_end=agreement.step_end, **kwargs)
        except torch.cuda.OutOfMemoryError:
            raise agreement.out_of_memory() from None
        agreement.after()
    except Stopped:  # stopped mid-call: reset what a finished call resets (a cache's state), as the pipeline would
        pipe.maybe_free_model_hooks()
        raise
    moved, once = crossed_since(served.prepared.ctx, before), spent_since(first)
    if dist.get_rank() != 0:
        return None, None, None
    if not served.job.spec.video:
        result.images = to_pil(result.images)
    seconds = phases.now() - started
    pixels = plan.unshuffle(list(result.frames if served.job.spec.video else result.images))
    sound = family_of(job.model).audio(pipe, result)
    audio = [None] * len(pixels) if sound is None else \
        plan.unshuffle([wav(w, sound[1]) for w in sound[0].float().cpu().numpy()])
    if fit_map and agreement.latents is not None:
        grid = latent_grid(pipe, agreement.latents[:1], job.height, job.width)[0]
        served.to_rgb = LatentToRgb(grid, np.asarray(result.images[0].convert("RGB")))
    records = []
    for request in batch:
        for index in range(request.n):
            record = run_record(request.job(served.job, index), served.prepared, result, phases, seconds, build_s,
                                moved, once)
            if switch_s is not None:  # the adapters this request ran, and what turning them on cost this call
                record["lora"] = {"adapters": [{"name": n, "scale": w} for n, w in request.lora],
                                  "switch_s": switch_s}
            records.append({**record, "request_id": request.id, "batch": len(plan.seeds)})
    return pixels, audio, records


def run(batch: list[Request], deadline_s: float = float("inf"), build_s: float = 0.0) -> dict | None:
    """One batch of requests (same call shape) on every rank, as one pipeline call: request i's n images have
    seeds seed, seed + 1, ... Rank 0 answers {"pixels": [a PIL image, or a video's PIL frames, each], "audio": [its
    sound as WAV bytes, or None, each], "records": [...]} in request order, or {"stopped": "late", "cancelled" or
    "out_of_memory", "step": step, "steps": steps} when every rank stopped the call together (a rank out of memory
    frees its cache: the group serves on)."""
    assert _SERVED is not None, "run before build"
    deadline = time.monotonic() + deadline_s
    try:
        pixels, audio, records = _generate(_SERVED, batch, deadline, build_s)
    except Stopped as stopped:
        return {"stopped": stopped.why, "step": stopped.step, "steps": batch[0].steps} \
            if dist.get_rank() == 0 else None
    return {"pixels": pixels, "audio": audio, "records": records} if dist.get_rank() == 0 else None


def generate(job: Job) -> dict | None:
    """The job's own generation, as one request: what `generate` runs on every rank."""
    build(job, serving=False)
    assert _SERVED is not None
    return run([Request.of(job)], build_s=_SERVED.prepared.build_s)


__all__ = ["Stopped", "build", "generate", "run", "warm_up"]
