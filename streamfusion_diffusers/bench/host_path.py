"""What the host does per attention call and per transformer block: Python function calls and microseconds.

At the sizes images are served at, a step waits on the host, so what counts is how much Python each call runs.
On every rank of a job: a Flux transformer parallelized by one layout; one attention call from diffusers'
`dispatch_attention_fn` (as a routed processor makes it: our backend, the route, `sp_attention`), one joint
block and one single block forward (the plan's layout set as the split hooks set it), and one whole forward,
each counted with `sys.setprofile` (Python calls, and C functions called from Python) after warm-up, and timed
without the profiler (the host's time to issue the call; on a GPU the device is synchronized only around the
batch). The same for plain diffusers (nothing parallelized, SDPA) as the floor. `calls` also keeps the
sequence of Python functions one attention call runs, so two layouts can be shown to run the same code.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from diffusers.models.attention_dispatch import dispatch_attention_fn

from ..context import ParallelContext, init_parallel
from ..core.config import ParallelConfig
from ..core.mesh import GroupCache
from ..diffusers.parallel_pipeline import parallelize, unparallelize
from ..models import TINY_FLUX
from ..models.build import build_transformer

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Shape:
    """The Flux transformer measured: heads, head dim, latent grid (rows, cols), text tokens, batch."""

    heads: int = 8
    head_dim: int = 16
    grid: tuple[int, int] = (16, 16)
    text: int = 16
    batch: int = 1

    def config(self) -> dict[str, Any]:
        return {**TINY_FLUX, "num_attention_heads": self.heads, "attention_head_dim": self.head_dim,
                "joint_attention_dim": 32, "axes_dims_rope": _rope_axes(self.head_dim)}


def _rope_axes(head_dim: int) -> tuple[int, int, int]:
    third = head_dim // 3 // 2 * 2
    return head_dim - 2 * third, third, third


@dataclass
class Count:
    """One call's cost: Python function calls, C function calls, host microseconds; `functions`: the Python
    functions it ran, in order (file relative to the package, or the module for other code, and name)."""

    python: float
    c: float
    host_us: float
    functions: tuple[str, ...] = ()


def count(call: Callable[[], object], device: torch.device, reps: int = 5, warmup: int = 3) -> Count:
    """`call`'s calls per run (the mean of `reps` runs after `warmup`) and its median host time per run."""
    for _ in range(warmup):
        call()
    python = c = 0
    functions: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal python, c
        if event == "call":
            python += 1
            if len(functions) < 100_000:
                code = frame.f_code
                where = code.co_filename
                where = os.path.relpath(where, PACKAGE) if where.startswith(PACKAGE) else frame.f_globals.get(
                    "__name__", where)
                functions.append(f"{where}:{code.co_name}")
        elif event == "c_call":
            c += 1

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    one = tuple(functions)
    sys.setprofile(profile)
    try:
        for _ in range(reps - 1):
            call()
    finally:
        sys.setprofile(None)
    times = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        for _ in range(10):
            call()
        times.append((time.perf_counter() - start) / 10 * 1e6)
        _sync(device)
    return Count(python / reps, c / reps, statistics.median(times), one)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class Measured:
    """One layout's (or plain diffusers') costs on this rank: per attention call, per joint block, per single
    block, per whole forward."""

    label: str
    attention: Count
    joint_block: Count
    single_block: Count
    forward: Count


def _inputs(shape: Shape, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    from diffusers import FluxPipeline

    g = torch.Generator(device="cpu").manual_seed(1)
    b, (rows, cols), cfg = shape.batch, shape.grid, shape.config()

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g).to(device, dtype)

    return {"hidden_states": randn(b, rows * cols, cfg["in_channels"]),
            "encoder_hidden_states": randn(b, shape.text, cfg["joint_attention_dim"]),
            "pooled_projections": randn(b, cfg["pooled_projection_dim"]),
            "timestep": torch.full((b,), 0.5, device=device, dtype=dtype),
            "img_ids": FluxPipeline._prepare_latent_image_ids(b, rows, cols, device, dtype),
            "txt_ids": torch.zeros(shape.text, 3, device=device, dtype=dtype), "return_dict": False}


def _recorded_blocks(model: torch.nn.Module, inputs: dict[str, Any], state: Any
                     ) -> tuple[list[tuple[torch.nn.Module, dict[str, Any]]], Any]:
    """One forward: the first joint and single block with the keyword inputs they got, and the token layout
    the split hooks set for them (None unparallelized)."""
    seen: list[tuple[torch.nn.Module, dict[str, Any]]] = []
    layouts: list[Any] = []

    def record(module: torch.nn.Module, _args: tuple, kwargs: dict[str, Any]) -> None:
        seen.append((module, dict(kwargs)))
        layouts.append(state.layout if state is not None else None)

    blocks = [model.transformer_blocks[0], model.single_transformer_blocks[0]]
    handles = [b.register_forward_pre_hook(record, with_kwargs=True) for b in blocks]
    try:
        model(**inputs)
    finally:
        for h in handles:
            h.remove()
    return seen, layouts[0]


@torch.no_grad()
def measure(model: torch.nn.Module, inputs: dict[str, Any], ctx: ParallelContext | None, label: str,
            device: torch.device, reps: int = 5) -> Measured:
    """One layout's costs (ctx None: plain diffusers). The attention call's q, k, v are this rank's rows of
    [text ; image] as the joint block's processor hands them to `dispatch_attention_fn`."""
    if ctx is not None:
        parallelize(model, ctx)
    try:
        state = model._streamfusion.state if ctx is not None else None
        blocks, layout = _recorded_blocks(model, inputs, state)
        processor = model.transformer_blocks[0].attn.processor
        heads, head_dim = model.config.num_attention_heads, model.config.attention_head_dim
        rows = layout.joint + layout.seq_lens[layout.rank] if layout is not None else \
            inputs["hidden_states"].shape[1] + inputs["encoder_hidden_states"].shape[1]
        g = torch.Generator(device="cpu").manual_seed(2)
        q, k, v = (torch.randn(inputs["hidden_states"].shape[0], rows, heads, head_dim, generator=g).to(
            device, inputs["hidden_states"].dtype) for _ in range(3))
        backend = getattr(processor, "_attention_backend", None)
        route = getattr(processor, "_parallel_config", None)

        def attention() -> object:
            return dispatch_attention_fn(q, k, v, backend=backend, parallel_config=route)

        def block(i: int) -> Callable[[], object]:
            module, kwargs = blocks[i]
            return lambda: module(**kwargs)

        if state is not None:
            state.layout = layout  # what the split hooks set before each forward
        try:
            counts = [count(attention, device, reps), count(block(0), device, reps), count(block(1), device, reps)]
        finally:
            if state is not None:
                state.layout = None
        counts.append(count(lambda: model(**inputs), device, reps=max(2, reps // 2), warmup=1))
        return Measured(label, *counts)
    finally:
        if ctx is not None:
            unparallelize(model)


def parse_layout(spec: str) -> tuple[str, ParallelConfig]:
    """'ulysses', 'ring', 'usp U2R1', 'tas U2R1' (or with ':' for the space) -> (label, config)."""
    method, _, degrees = spec.replace(":", " ").partition(" ")
    if not degrees:
        return method, ParallelConfig(method=method)
    u, _, r = degrees.upper().removeprefix("U").partition("R")
    return f"{method} {degrees.upper()}", ParallelConfig(method=method, ulysses=int(u), ring=int(r))


def run_rank(layouts: list[str], shape: Shape, reps: int = 5, dtype: torch.dtype = torch.float32) -> list[Measured]:
    """On every rank of a job: plain diffusers, then each layout (one context each, one set of groups)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    model = build_transformer(shape.config(), dtype=dtype, device=device)
    inputs = _inputs(shape, device, dtype)
    out = [measure(model, inputs, None, "diffusers (one rank's work, no communication)", device, reps)]
    groups = GroupCache()
    for spec in layouts:
        label, config = parse_layout(spec)
        ctx = init_parallel(config, groups=groups)
        out.append(measure(model, inputs, ctx, label, device, reps))
        ctx.close()
    return out


__all__ = ["Count", "Measured", "Shape", "count", "measure", "parse_layout", "run_rank"]
