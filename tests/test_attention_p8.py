"""Every method on meshes 2x4, 4x2 and 1x8 (8 gloo processes) against single-process attention."""
from __future__ import annotations

import pytest
from attention_suite import METHODS, layout_id, layout_problem, layouts, problems
from sp_cases import check

from streamfusion_diffusers import ParallelConfig
from streamfusion_diffusers.runtime.pool import ProcessPool

WORLD = 8
MESHES = [(2, 4), (4, 2), (1, 8)]


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(WORLD) as p:
        yield p


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"{m[0]}x{m[1]}")
def test_methods_match_single_process(pool, mesh, method):
    config = ParallelConfig(machines=mesh[0], gpus_per_machine=mesh[1], method=method)
    for problem, pass_lens in problems(method, WORLD):
        check(pool, config, problem, pass_lens)


@pytest.mark.parametrize("config", layouts(WORLD), ids=layout_id)
def test_every_layout(pool, config):
    check(pool, config, layout_problem(WORLD))
