"""What a server makes before it says ready, so that no request of a warmed size waits for a compile.

`serve --warm-sizes` names the sizes (default: the model's own). Each is made once with one image; a server of
compiled blocks makes each again with the most images the batch planner puts in one call (`--max-batch`), since
dynamo compiles a batch of one apart from larger ones (a symbolic size is never 1).

The token count is left to dynamo's automatic dynamic shapes: not marked dynamic by hand, nor padded to buckets.
The first size compiles static, inductor's kernels made for the exact shapes of the size most requests ask for;
a second size compiles once more with the token count symbolic (and the layout's rows per rank with it: host
ints on the processors, which diffusers/compiled.py lets dynamo make symbolic), and that graph runs every later
size. So with two warm sizes no request compiles after ready, and with one the first request of another size
compiles once (at each of the two batch kinds). Marking by hand has nothing to mark: the blocks' inputs are made
inside the transformer's forward, out of reach of a mark outside the compiled region, and `dynamic=True` would
compile the first size symbolic too. A symbolic graph keeps fullgraph (its image is the eager one:
tests/test_serve_compile.py) and the CUDA-graph path: each shape's first call runs the compiled code eager
before its capture, so nothing compiles inside a capture. Buckets would pad the image tokens, which every
attention would then see: the output would no longer be the size's own.

A request that still compiles (a size or batch the warm-up did not make) runs all the same: its call's run record
counts the compile as one-time work, which the supervisor says once per size and /metrics counts
(`compile_stall`).
"""
from __future__ import annotations

import argparse
from typing import Any

from ..runtime.job import Job
from .limits import SIZE

Size = tuple[int, int]  # width, height in pixels


def parse_sizes(text: str) -> tuple[Size, ...]:
    """`--warm-sizes WxH[,WxH...]`, as a request's `size` names one."""
    sizes = []
    for part in text.split(","):
        found = SIZE.fullmatch(part.strip())
        if found is None:
            raise argparse.ArgumentTypeError(f"{part.strip()!r}: each size must be WIDTHxHEIGHT in pixels, "
                                             f"comma-separated (e.g. 1024x1024,768x1344)")
        sizes.append((int(found[1]), int(found[2])))
    return tuple(dict.fromkeys(sizes))


def check_sizes(job: Job, sizes: tuple[Size, ...] | None) -> tuple[Size, ...]:
    """The sizes to warm (None: the job's own), each one a request may ask for, or one line naming the fix."""
    step = job.spec.size_step
    for width, height in sizes or ():
        if width <= 0 or height <= 0 or width % step or height % step:
            raise ValueError(f"--warm-sizes {width}x{height}: width and height must be positive multiples of {step} "
                             f"for {job.model} (e.g. {max(step, width // step * step)}x"
                             f"{max(step, height // step * step)})")
        tokens = job.spec.image_tokens(height, width, job.frames)
        if tokens < job.world_size:
            raise ValueError(f"--warm-sizes {width}x{height}: {tokens} image tokens, fewer than the {job.world_size} "
                             f"ranks of a parallel group; warm a larger size")
    return sizes or ((job.width, job.height),)


def warm_shapes(job: Job, sizes: tuple[Size, ...], max_batch: int) -> tuple[tuple[int, int, int], ...]:
    """The warm-up's calls (width, height, images): each size with one image and, where the blocks compile and
    requests share calls, with `max_batch`."""
    batches = (1, max_batch) if job.compile and max_batch > 1 else (1,)
    return tuple((width, height, n) for width, height in sizes for n in batches)


def compile_stall(records: list[dict[str, Any]]) -> tuple[str, float] | None:
    """(the call's size as WxH, its seconds compiling) where a served call compiled first, else None; every
    record of a call carries the call's one-time work."""
    seconds = records[0].get("one_time_s", {}).get("compile", 0.0) if records else 0.0
    return (f"{records[0]['width']}x{records[0]['height']}", seconds) if seconds > 0 else None


__all__ = ["check_sizes", "compile_stall", "parse_sizes", "warm_shapes"]
