"""The pipelined Ulysses (head groups: all-to-all beside the projections) and Flux.1's single blocks with the
all-to-all beside their MLP projections, on 4 gloo processes, float32.

The schedule alone against single-process attention of the whole projected sequence (float64, computed from
the unsplit input), with uneven slices and joint tokens; tiny Flux.1 and Qwen-Image through `parallelize`
against the unparallelized model, with the pipeline seen to run; the group count's checks.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from model_cases import Case as FluxCase
from plan_cases import Case, context

import streamfusion_diffusers.diffusers.overlap_mlp as overlap_mlp
import streamfusion_diffusers.diffusers.processors.overlap as overlap_processors
from streamfusion_diffusers import ParallelConfig, parallelize, unparallelize
from streamfusion_diffusers.attention.overlap import overlap_plan, run_overlapped
from streamfusion_diffusers.runtime.pool import ProcessPool
from streamfusion_diffusers.core.exactness import reference_attention, relative_error
from streamfusion_diffusers.models.build import build_transformer

WORLD = 4
TOL = 1e-4
ULYSSES = ParallelConfig(method="ulysses", overlap_groups=2)  # asked for: the pipeline runs eager too


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(WORLD) as p:
        yield p


def _layer(config: ParallelConfig, heads: int, lens: list[int], joint: int, projected: bool) -> dict[str, Any]:
    """On every rank: one layer through `run_overlapped` (this rank's rows of a seeded input, sliced weights)
    against the float64 attention of the whole sequence, projected by the whole weights."""
    ctx = context(config)
    rank, b, d, c = dist.get_rank(), 2, 8, 24
    g = torch.Generator().manual_seed(7)
    x = torch.randn(b, joint + sum(lens), c, generator=g)
    w = [torch.randn(heads * d, c, generator=g) / c ** 0.5 for _ in range(3)]
    bias = [torch.randn(heads * d, generator=g) for _ in range(3)]
    w_out, b_out = torch.randn(c, heads * d, generator=g) / (heads * d) ** 0.5, torch.randn(c, generator=g)
    start = joint + sum(lens[:rank])
    mine = torch.cat([x[:, :joint], x[:, start:start + lens[rank]]], dim=1)
    like = mine.new_empty(()).expand(b, mine.shape[1], heads, d)
    plan = overlap_plan(ctx, like, joint, lens)
    n = heads * d // plan.groups

    def project(i: int):
        rows = slice(i * n, (i + 1) * n)
        return tuple(torch.nn.functional.linear(mine, wi[rows], bi[rows]).unflatten(-1, (-1, d))
                     for wi, bi in zip(w, bias))

    def out_project(i: int, o: torch.Tensor):
        return (torch.nn.functional.linear(o.flatten(2, 3), w_out[:, i * n:(i + 1) * n], b_out if i == 0 else None),)

    got = run_overlapped(ctx, plan, like, project, out_project if projected else None)
    q, k, v = (torch.nn.functional.linear(x.double(), wi.double(), bi.double()).unflatten(-1, (-1, d))
               for wi, bi in zip(w, bias))
    ref = reference_attention(q, k, v)
    ref = torch.cat([ref[:, :joint], ref[:, start:start + lens[rank]]], dim=1)
    if projected:
        got, ref = got[0], torch.nn.functional.linear(ref.flatten(2, 3), w_out.double(), b_out.double())
    return {"groups": plan.groups, "error": relative_error(got, ref)}


@pytest.mark.parametrize("heads, lens, joint, projected, groups", [
    (8, [5, 3, 4, 4], 0, True, 2),      # uneven slices, output projection summed over the groups
    (12, [7, 7, 6, 9], 5, True, 3),     # joint tokens in front, three groups
    (8, [4, 4, 4, 4], 3, False, 2),     # no output projection: the heads put back together
])
def test_layer_matches_single_process_attention(pool, heads, lens, joint, projected, groups):
    config = ParallelConfig(method="ulysses", overlap_groups=groups)
    for res in pool.run(_layer, config, heads, lens, joint, projected):
        assert res["groups"] == groups, res
        assert res["error"] <= TOL, res


def _model(config: ParallelConfig, family: str, case: Any) -> dict[str, Any]:
    """On every rank: a tiny model parallelized, against itself unparallelized; the pipelined calls counted."""
    model = build_transformer(case.config, seed=0) if family == "flux" else case.model(0)
    inputs = case.inputs(1)
    runs: list[int] = []  # the head groups of each pipelined attention call: the processors' and the MLP hook's
    mlp_runs: list[int] = []
    real = overlap_processors.run_overlapped

    def spy(into: list[int]):
        def run(ctx, plan, *args, **kwargs):
            into.append(plan.groups)
            return real(ctx, plan, *args, **kwargs)
        return run

    overlap_processors.run_overlapped, overlap_mlp.run_overlapped = spy(runs), spy(mlp_runs)
    try:
        with torch.no_grad():
            reference = model(**inputs, return_dict=False)[0]
            parallelize(model, context(config))
            processors = sorted({type(p).__name__ for p in model.attn_processors.values()})
            out = model(**inputs, return_dict=False)[0]
            unparallelize(model)
    finally:
        overlap_processors.run_overlapped = overlap_mlp.run_overlapped = real
    return {"error": relative_error(out, reference), "runs": runs, "mlp_runs": mlp_runs, "processors": processors}


MODELS = {
    "flux-uneven": ("flux", FluxCase("flux", (6, 5), text=7, overrides={"num_layers": 2, "num_single_layers": 2})),
    "qwen-image-uneven-batch2": ("qwen-image", Case("qwen-image", (3, 5), text=6, batch=2)),
    "qwen-image-joint-text": ("qwen-image", Case("qwen-image", (3, 5), text=3)),  # text shorter than the ranks
}


@pytest.mark.parametrize("name", MODELS)
def test_models_match_unparallelized(pool, name):
    family, case = MODELS[name]
    joint = case.config["num_layers"] if family == "flux" else 1
    single = case.config["num_single_layers"] if family == "flux" else 0
    for res in pool.run(_model, ULYSSES, family, case):
        assert res["runs"] == [2] * joint, res  # every attention pipelined, two groups of one head per rank,
        assert res["mlp_runs"] == [1] * single, res  # Flux's single blocks beside their MLP, one group
        assert res["error"] <= TOL, res


@pytest.mark.parametrize("groups", [1, None])  # off, as asked and by default
def test_one_group_and_the_default_run_flux_twins_on_the_plain_path(pool, groups):
    family, case = MODELS["flux-uneven"]
    for res in pool.run(_model, ParallelConfig(method="ulysses", overlap_groups=groups), family, case):
        assert res["processors"] == ["FluxOverlapAttnProcessor"] and res["runs"] == [], res  # RoPE in one pass
        assert res["mlp_runs"] == [1] * case.config["num_single_layers"], res  # on by default
        assert res["error"] <= TOL, res


def test_single_blocks_stock_without_overlap_mlp(pool):
    family, case = MODELS["flux-uneven"]
    for res in pool.run(_model, ParallelConfig(method="ulysses", overlap_mlp=False), family, case):
        assert res["runs"] == res["mlp_runs"] == [] and res["error"] <= TOL, res


def _parallelized_again(case: Any) -> dict[str, Any]:
    """On every rank: a model parallelized, put back, then parallelized again: the MLP overlap runs the second
    time too."""
    model = build_transformer(case.config, seed=0)
    with torch.no_grad():
        parallelize(model, context(ParallelConfig(method="ulysses")))
        unparallelize(model)  # the single blocks keep an empty hook registry
        runs: list[int] = []
        real = overlap_mlp.run_overlapped

        def spy(ctx, plan, *args, **kwargs):
            runs.append(plan.groups)
            return real(ctx, plan, *args, **kwargs)

        overlap_mlp.run_overlapped = spy
        try:
            parallelize(model, context(ParallelConfig(method="ulysses")))
            model(**case.inputs(1))
            unparallelize(model)
        finally:
            overlap_mlp.run_overlapped = real
    return {"mlp_runs": runs}


def test_a_model_parallelized_again_gets_the_overlap(pool):
    _, case = MODELS["flux-uneven"]
    for res in pool.run(_parallelized_again, case):
        assert res["mlp_runs"] == [1] * case.config["num_single_layers"], res


@pytest.mark.parametrize("name", ["qwen-image-uneven-batch2", "flux-uneven"])
def test_layouts_with_ring_stages_run_the_plain_path(pool, name):
    family, case = MODELS[name]
    usp = ParallelConfig(machines=2, gpus_per_machine=2, method="usp", ulysses=2, ring=2, overlap_groups=2)
    for res in pool.run(_model, usp, family, case):
        assert res["processors"] == [f"{'QwenImage' if family != 'flux' else 'Flux'}OverlapAttnProcessor"], res
        assert res["runs"] == res["mlp_runs"] == [], res
        assert res["error"] <= TOL, res


def _groups_error(config: ParallelConfig) -> str:
    like = torch.empty(()).expand(1, 4, 8, 8)
    try:
        overlap_plan(context(config), like)
    except ValueError as err:
        return str(err)
    return "no error"


def test_groups_that_do_not_divide_the_heads_per_rank_are_refused(pool):
    errors = pool.run(_groups_error, ParallelConfig(method="ulysses", overlap_groups=3))
    assert all(e.startswith("overlap_groups=3 does not divide the 2 heads each rank attends") for e in errors), errors
    with pytest.raises(ValueError, match="overlap_groups must be a positive integer"):
        ParallelConfig(overlap_groups=0)
