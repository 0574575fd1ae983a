"""How a job's forward runs on GPUs, and why: replayed from CUDA graphs, and with its repeated blocks compiled.

Each choice is on by default where it is exact and measured to pay, off where it is not, and asked for where it
cannot run refused in one line that names the fix; the why goes into run.json and the commands' first lines.
"""
from __future__ import annotations

import argparse
from typing import Any

from ..models import MODELS


def graph_choice(args: argparse.Namespace, gpu: bool) -> tuple[bool, str]:
    """Whether the forward replays from CUDA graphs, and why: on by default on GPUs wherever a replay is exact;
    asked for where it cannot be, one line that names the fix."""
    blockers = []  # (why the default runs eager, the refusal when --cuda-graph asks anyway)
    if args.cache:
        why = f"--cache {args.cache} decides per step what to run, which a CUDA graph replays unchanged"
        blockers.append((why, f"{why}; drop --cuda-graph or --cache"))
    if args.cuda_graph:
        if blockers:
            raise ValueError(blockers[0][1])
        if not gpu:
            from ..diffusers.graphs import NO_GPU
            raise ValueError(NO_GPU)
        return True, "asked for"
    if args.cuda_graph is False:
        return False, "--no-cuda-graph"
    if not gpu:
        return False, "no GPU (CUDA graphs need one)"
    if blockers:
        return False, f"eager: {blockers[0][0]}"
    return True, "the default on GPUs"


def compile_choice(args: argparse.Namespace, job: Any, serving: bool) -> tuple[bool, str]:
    """Whether the repeated blocks of `job` (job.py's Job, resolved but for this) compile, and why: asked for, or
    by default where a measured compiled step pays for the compile over the job's steps (choice/compiling.py; a
    server: never by default), for what was measured: graphs on, whole weights, nothing stacked, no emulated
    link."""
    if args.compile:
        return True, "asked for"
    if args.compile is False:
        return False, "--no-compile"
    if not job.gpu:
        return False, "no GPU (the CPU runs eager)"
    unmeasured = [what for what, on in (("--cache", job.stack.cache), ("--lora", job.stack.loras or job.stack.adapters),
                                        ("--quantize", job.stack.quantize), ("--shard-weights", job.shard_weights),
                                        ("--emulate-link", job.parallel.emulate_link),
                                        ("CUDA graphs off", not job.cuda_graph)) if on]
    if unmeasured:
        return False, f"no compiled step measured with {unmeasured[0]} (--compile to try it)"
    from ..choice.compiling import compile_pays

    tokens = MODELS[job.model].image_tokens(job.height, job.width, job.frames)
    return compile_pays(job.model, tokens, job.world_size, None if serving else job.steps - 1)


__all__ = ["compile_choice", "graph_choice"]
