"""Flux and CogVideoX transformers parallelized over 8 gloo processes (2 machines x 4) match unparallelized ones."""
from __future__ import annotations

import pytest
from model_cases import COGVIDEOX_CASES, FLUX_CASES, METHODS, check

from streamfusion_diffusers import ParallelConfig
from streamfusion_diffusers.runtime.pool import ProcessPool

pytestmark = pytest.mark.slow  # 8 ranks: test_processors_p4.py checks the same on 4; pytest -m slow runs it

WORLD = 8
CASES = {**{f"flux-{k}": v for k, v in FLUX_CASES.items()}, **{f"cogvideox-{k}": v for k, v in COGVIDEOX_CASES.items()}}


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(WORLD) as p:
        yield p


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("method", METHODS)
def test_parallel_transformer_matches(pool, method, case):
    check(pool, ParallelConfig(machines=2, gpus_per_machine=4, method=method), CASES[case])


@pytest.mark.parametrize("case", ["flux-text-sharded-uneven-image", "cogvideox-rope-text-joint"])
def test_torus_inside_one_machine_and_mixed_degrees(pool, case):
    check(pool, ParallelConfig(machines=1, gpus_per_machine=8, method="torus"), CASES[case])
    check(pool, ParallelConfig(machines=2, gpus_per_machine=4, method="torus", ulysses=4, torus=2), CASES[case])
    check(pool, ParallelConfig(machines=2, gpus_per_machine=4, method="usp", ulysses=2, ring=4), CASES[case])
