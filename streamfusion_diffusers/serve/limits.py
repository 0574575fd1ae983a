"""What one request may ask for, as `serve`'s --max-* options give it or, on GPUs, as the memory planner finds it
fits one GPU of the group; found in a thread (`planned_limits`), beside the ranks' start."""
from __future__ import annotations

import argparse
import logging
import math
import re
import threading
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from ..runtime.job import Job

# on the CPU, requests up to 16 x the model's own pixels (4 x each side: 256x256 for the tiny models): a tiny model
# at 512x512 (Open WebUI's default) takes minutes on a few cores, with every request queued behind it
CPU_PIXELS = 16
SIZE = re.compile(r"(\d{1,6})x(\d{1,6})")  # a size as requests and --warm-sizes name it: WIDTHxHEIGHT
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """What one request may ask for (`serve`'s --max-* options)."""

    max_n: int
    max_steps: int
    max_pixels: int
    max_frames: int
    max_prompt_chars: int


def check_pixels(sizes: tuple[tuple[int, int], ...] | None, max_pixels: int) -> None:
    """Refuse a warm size larger than a request may ask for (it would warm what no request runs)."""
    for width, height in sizes or ():
        if width * height > max_pixels:
            raise ValueError(f"--warm-sizes {width}x{height}: {width * height} pixels, more than the {max_pixels} a "
                             f"request may ask for: raise --max-pixels or warm a smaller size")


def limits(args: argparse.Namespace, job: Job) -> Limits:
    """The request limits: as given, else on GPUs what the memory planner says fits one GPU of the group (the
    largest square image, the most frames at the model's own size), else on the CPU CPU_PIXELS x the model's."""
    pixels, frames = CPU_PIXELS * job.spec.height * job.spec.width, 2 * job.spec.frames
    if job.gpu and (args.max_pixels is None or args.max_frames is None):
        from ..models.memory import GIB, largest_size, streamed_choice

        gib = torch.cuda.get_device_properties(0).total_memory / GIB
        cfg = job.parallel.cfg if isinstance(job.parallel.cfg, int) else 1  # "auto": the most tokens per rank
        streamed = job.streamed_blocks  # auto: as the group's build chooses, at the default size
        if job.shard_weights and streamed == "auto":
            streamed = streamed_choice(job.model, job.height, job.width, job.frames, job.world_size, cfg=cfg)
        pixels, frames = largest_size(job.model, job.world_size, gib, cfg=cfg, sharded=job.shard_weights,
                                      streamed=streamed)
        if pixels == 0:
            raise ValueError(f"{job.model} does not fit {gib:.0f} GiB GPUs on {job.world_size} rank(s) at any size "
                             f"(streamfusion plan --memory says why): add --shard-weights or ranks, or give "
                             f"--max-pixels to try anyway")
    if not job.gpu and args.max_pixels is None:
        side = math.isqrt(CPU_PIXELS)
        logger.info("on the CPU a request may ask for at most %d pixels (%dx%d): larger ones would take minutes "
                    "each, every request waiting behind them; --max-pixels raises the limit", pixels,
                    side * job.spec.width, side * job.spec.height)
    check_pixels(args.warm_sizes, args.max_pixels or pixels)
    return Limits(max_n=args.max_n, max_steps=args.max_steps, max_pixels=args.max_pixels or pixels,
                  max_frames=args.max_frames or frames or 2 * job.spec.frames, max_prompt_chars=args.max_prompt_chars)


def planned_limits(args: argparse.Namespace, job: Job) -> Future:
    """`limits`, found in a thread: on GPUs the memory planner (diffusers imported, the pipeline built on the meta
    device, sizes bisected) takes about as long as the ranks' own start, beside which it now runs."""
    found: Future = Future()

    def plan() -> None:
        try:
            found.set_result(limits(args, job))
        except BaseException as err:  # noqa: BLE001 - said by the command when the start fails on it
            found.set_exception(err)

    threading.Thread(target=plan, name="streamfusion-limits", daemon=True).start()
    return found


__all__ = ["CPU_PIXELS", "SIZE", "Limits", "check_pixels", "limits", "planned_limits"]
