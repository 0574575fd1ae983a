"""Flux and CogVideoX transformers parallelized over 4 gloo processes match the unparallelized ones.

Every method on the 2x2, 1x4 and 4x1 meshes, for every tiny-model case: Flux joint and single blocks with the
text split or replicated, CogVideoX with RoPE or sin-cos positions, 1.0 and 1.5 patching, uneven slices.
"""
from __future__ import annotations

import dataclasses

import pytest
from model_cases import COGVIDEOX_CASES, FLUX_CASES, METHODS, Case, check, expect_error, refuse_foreign_processors

from streamfusion_diffusers import ParallelConfig
from streamfusion_diffusers.runtime.pool import ProcessPool

WORLD = 4
MESHES = [(2, 2), (1, 4), (4, 1)]
CASES = {**{f"flux-{k}": v for k, v in FLUX_CASES.items()}, **{f"cogvideox-{k}": v for k, v in COGVIDEOX_CASES.items()}}


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(WORLD) as p:
        yield p


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"{m[0]}x{m[1]}")
def test_parallel_transformer_matches(pool, mesh, method, case):
    check(pool, ParallelConfig(machines=mesh[0], gpus_per_machine=mesh[1], method=method), CASES[case])


@pytest.mark.parametrize("family", ["flux", "cogvideox"])
def test_heads_that_do_not_divide_fail_naming_the_fix(pool, family):
    base = FLUX_CASES["text-joint-batch2"] if family == "flux" else COGVIDEOX_CASES["rope-text-joint"]
    case = dataclasses.replace(base, overrides={**base.overrides, "num_attention_heads": 6})
    errors = pool.run(expect_error, ParallelConfig(machines=2, gpus_per_machine=2, method="ulysses"), case)
    assert all("does not divide the 6 heads" in e and "ulysses in [1, 2]" in e for e in errors), errors
    errors = pool.run(expect_error, ParallelConfig(machines=2, gpus_per_machine=2, method="torus", ulysses=4), case)
    assert all("valid ulysses degrees for 4 ranks: [1, 2]" in e for e in errors), errors


def test_sequence_shorter_than_the_ranks_fails_naming_the_fix(pool):
    case = Case("flux", (1, 3), text=8)
    errors = pool.run(expect_error, ParallelConfig(machines=2, gpus_per_machine=2, method="torus"), case)
    assert all("3 image/video tokens cannot be split over 4 ranks; raise the resolution" in e for e in errors), errors


def test_processors_it_would_lose_are_refused(pool):
    errors = pool.run(refuse_foreign_processors, ParallelConfig(machines=2, gpus_per_machine=2, method="torus"))
    assert all("AttnProcessor2_0" in e and "unload them" in e for e in errors), errors
