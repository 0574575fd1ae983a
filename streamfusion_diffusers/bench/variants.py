"""Ways to run one of our layouts in `streamfusion bench --variants` (what the fixed cost of a layer and of a step
becomes), so that each is timed beside the plain (eager) run in one job:

- eager: as `parallelize` runs it by default;
- cuda-graph: replayed from a CUDA graph (a layer: the sp_attention call; a step: the whole forward,
  diffusers/graphs.py);
- compile: each repeated block through torch.compile(fullgraph=True), as diffusers' `compile_repeated_blocks`
  does; attention compiles into the graph as a custom op (ours: `streamfusion::sp_attention`, the bound's:
  `streamfusion::local_attention`).

The no-communication bound runs the variants that do not communicate (eager, cuda-graph, compile), so that a
variant is compared with a bound that had the same help; baselines run eager only.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from ..core.config import METHODS
from ..diffusers.compiled import RECOMPILE_LIMIT, repeated_blocks, uncompile_blocks

VARIANTS = ("eager", "cuda-graph", "compile")
# the levels each variant means something at: a graph of the whole forward is not replayed by the block level,
# and compile acts on blocks, which the layer level does not run
LEVELS = {"eager": ("layer", "block", "step"), "cuda-graph": ("layer", "step"), "compile": ("block", "step")}
BOUND_VARIANTS = VARIANTS
COMPILE_OPTIONS: dict[str, Any] = {"fullgraph": True, "dynamic": False}


def parse_variants(spec: str) -> tuple[str, ...]:
    variants = tuple(dict.fromkeys(x.strip() for x in spec.split(",") if x.strip()))
    unknown = [x for x in variants if x not in VARIANTS]
    if unknown or not variants:
        raise ValueError(f"unknown variant(s) {unknown or [spec]} in --variants; choose from {', '.join(VARIANTS)} "
                         f"(comma-separated, e.g. --variants eager,cuda-graph)")
    return variants


def suffix(variant: str) -> str:
    """What a variant adds to a case's label and method name ("" for eager)."""
    return "" if variant == "eager" else f"+{variant}"


def graphed(call: Callable[[Tensor, Tensor, Tensor], Tensor]) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """`call(q, k, v)` captured in a CUDA graph at its first call for these tensors, replayed after: the layer's
    launches and Python run once. The bench passes the same tensors every time; the output is the graph's own
    (static) tensor, rewritten by each replay."""
    from ..diffusers.graphs import capture  # imports diffusers: only when a graph variant runs

    graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, Tensor]] = {}

    def replay(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        key = tuple((x.data_ptr(), tuple(x.shape)) for x in (q, k, v))
        if key not in graphs:
            graphs[key] = capture(lambda: call(q, k, v))
        graph, out = graphs[key]
        graph.replay()
        return out

    return replay


def parallelize_options(variant: str) -> dict[str, Any]:
    """The `parallelize` keyword arguments of a variant."""
    return {"cuda_graph": variant == "cuda-graph"}


@contextmanager
def compiled(model: torch.nn.Module, variant: str) -> Iterator[None]:
    """The model's blocks compiled for the "compile" variant (nothing for the others), eager again afterwards."""
    if variant != "compile":
        yield
        return
    # each case compiles afresh: its shapes (its share of the tokens, the bound's or another layout's) are not
    # the last case's, and a block's code would otherwise pile up recompiles across cases until dynamo's limit
    torch._dynamo.reset()
    torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    torch._dynamo.config.fail_on_recompile_limit_hit = True  # raise with the guard's reason, never run on
    for block in repeated_blocks(model):
        block.compile(**COMPILE_OPTIONS)
    try:
        yield
    finally:
        uncompile_blocks(model)


def with_variants(cases: list, variants: tuple[str, ...], levels: tuple[str, ...]) -> list:  # of layer.Case
    """Each of our cases once per variant that means something at one of `levels` (the bound: the eager one
    always, the non-communicating others as asked); baselines as they are."""
    out = []
    for case in cases:
        ours = case.method in METHODS or case.method == "auto"
        allowed = VARIANTS if ours else BOUND_VARIANTS if case.method == "bound" else ("eager",)
        wanted = ("eager", *variants) if case.method == "bound" else variants if ours else ("eager",)
        out += [replace(case, variant=v) for v in dict.fromkeys(wanted)
                if v in allowed and set(LEVELS[v]) & set(levels)]
    return out
