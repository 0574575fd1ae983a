"""Ulysses with its all-to-alls beside the caller's own work, and Flux.1's single blocks with them beside their MLP
projections, on 4 gloo processes, float32.

The schedule alone against single-process attention of the whole projected sequence (float64, computed from
the unsplit input), with uneven slices and joint tokens, its work beside seen to run; tiny Flux.1 through
`parallelize` against the unparallelized model, with the single blocks' overlap seen to run where it applies.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from model_cases import Case as FluxCase
from plan_cases import context

import streamfusion_diffusers.diffusers.overlap_mlp as overlap_mlp
from streamfusion_diffusers import ParallelConfig, parallelize, unparallelize
from streamfusion_diffusers.attention.overlap import overlap_plan, run_overlapped
from streamfusion_diffusers.core.exactness import reference_attention, relative_error
from streamfusion_diffusers.models.build import build_transformer
from streamfusion_diffusers.runtime.pool import ProcessPool

WORLD = 4
TOL = 1e-4
ULYSSES = ParallelConfig(method="ulysses")


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(WORLD) as p:
        yield p


def _layer(heads: int, lens: list[int], joint: int) -> dict[str, Any]:
    """On every rank: one layer through `run_overlapped` (this rank's rows of a seeded input) against the float64
    attention of the whole sequence; which work beside ran, in order."""
    ctx = context(ULYSSES)
    rank, b, d, c = dist.get_rank(), 2, 8, 24
    g = torch.Generator().manual_seed(7)
    x = torch.randn(b, joint + sum(lens), c, generator=g)
    w = [torch.randn(heads * d, c, generator=g) / c ** 0.5 for _ in range(3)]
    start = joint + sum(lens[:rank])
    mine = torch.cat([x[:, :joint], x[:, start:start + lens[rank]]], dim=1)
    q, k, v = (torch.nn.functional.linear(mine, wi).unflatten(-1, (-1, d)) for wi in w)
    plan = overlap_plan(ctx, q, joint, lens)
    beside: list[str] = []
    got = run_overlapped(ctx, plan, q, k, v, lambda: beside.append("first"), lambda: beside.append("last"))
    whole = (torch.nn.functional.linear(x.double(), wi.double()).unflatten(-1, (-1, d)) for wi in w)
    ref = reference_attention(*whole)
    ref = torch.cat([ref[:, :joint], ref[:, start:start + lens[rank]]], dim=1)
    return {"error": relative_error(got, ref), "beside": beside}


@pytest.mark.parametrize("heads, lens, joint", [
    (8, [5, 3, 4, 4], 0),     # uneven slices
    (12, [7, 7, 6, 9], 5),    # joint tokens in front
])
def test_layer_matches_single_process_attention(pool, heads, lens, joint):
    for res in pool.run(_layer, heads, lens, joint):
        assert res["beside"] == ["first", "last"], res
        assert res["error"] <= TOL, res


@contextmanager
def overlapped_calls() -> Iterator[list[int]]:
    """The single blocks' overlapped attention calls made inside the block, one entry each."""
    runs: list[int] = []
    real = overlap_mlp.run_overlapped

    def spy(*args, **kwargs):
        runs.append(1)
        return real(*args, **kwargs)

    overlap_mlp.run_overlapped = spy
    try:
        yield runs
    finally:
        overlap_mlp.run_overlapped = real


def _model(config: ParallelConfig, case: Any) -> dict[str, Any]:
    """On every rank: a tiny Flux.1 parallelized, against itself unparallelized; the single blocks' overlapped
    attention calls counted."""
    model = build_transformer(case.config, seed=0)
    inputs = case.inputs(1)
    with overlapped_calls() as runs, torch.no_grad():
        reference = model(**inputs, return_dict=False)[0]
        parallelize(model, context(config))
        processors = sorted({type(p).__name__ for p in model.attn_processors.values()})
        out = model(**inputs, return_dict=False)[0]
        unparallelize(model)
    return {"error": relative_error(out, reference), "runs": runs, "processors": processors}


FLUX = FluxCase("flux", (6, 5), text=7, overrides={"num_layers": 2, "num_single_layers": 2})


def test_single_blocks_run_beside_their_mlp_by_default(pool):
    for res in pool.run(_model, ULYSSES, FLUX):
        assert res["processors"] == ["FluxRotaryAttnProcessor"], res  # RoPE in one pass
        assert res["runs"] == [1] * FLUX.config["num_single_layers"], res
        assert res["error"] <= TOL, res


def test_single_blocks_stock_without_overlap_mlp(pool):
    for res in pool.run(_model, ParallelConfig(method="ulysses", overlap_mlp=False), FLUX):
        assert res["runs"] == [] and res["error"] <= TOL, res


def test_layouts_with_ring_stages_run_the_stock_blocks(pool):
    usp = ParallelConfig(machines=2, gpus_per_machine=2, method="usp", ulysses=2, ring=2)
    for res in pool.run(_model, usp, FLUX):
        assert res["runs"] == [] and res["error"] <= TOL, res


def _parallelized_again(case: Any) -> dict[str, Any]:
    """On every rank: a model parallelized, put back, then parallelized again: the MLP overlap runs the second
    time too."""
    model = build_transformer(case.config, seed=0)
    with torch.no_grad():
        parallelize(model, context(ULYSSES))
        unparallelize(model)  # the single blocks keep an empty hook registry
        with overlapped_calls() as runs:
            parallelize(model, context(ULYSSES))
            model(**case.inputs(1))
            unparallelize(model)
    return {"mlp_runs": runs}


def test_a_model_parallelized_again_gets_the_overlap(pool):
    for res in pool.run(_parallelized_again, FLUX):
        assert res["mlp_runs"] == [1] * FLUX.config["num_single_layers"], res
