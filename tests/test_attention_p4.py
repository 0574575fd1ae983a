"""Every method on meshes 1x4, 4x1 and 2x2 (4 gloo processes) against single-process attention."""
from __future__ import annotations

import pytest
from attention_suite import METHODS, layout_id, layout_problem, layouts, problems
from sp_cases import check, compare, run_rank

from streamfusion_diffusers import ParallelConfig
from streamfusion_diffusers.backends.torch_dist import TorchTransport, exchange_as_all_to_all
from streamfusion_diffusers.runtime.pool import ProcessPool

WORLD = 4
MESHES = [(1, 4), (4, 1), (2, 2)]


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


def _run_rank_exchanging_by_all_to_all(config: ParallelConfig, problem, pass_lens: bool):
    """run_rank with every exchange (and so every all-to-all) sent as one packed all-to-all, as inside a
    CUDA-graph capture on NCCL."""
    original = TorchTransport.exchange
    TorchTransport.exchange = lambda self, sends, recvs, group: exchange_as_all_to_all(sends, recvs, group)
    try:
        return run_rank(config, problem, pass_lens)
    finally:
        TorchTransport.exchange = original


@pytest.mark.parametrize("method", ["ulysses", "ring", "usp", "tas", "torus"])
@pytest.mark.parametrize("mesh", [(4, 1), (2, 2)], ids=lambda m: f"{m[0]}x{m[1]}")
def test_exchanges_as_one_all_to_all_match_single_process(pool, mesh, method):
    """The graph-capture path of the torch transport: every schedule's exchanges are collective over their
    group (each member calls them in the same order), so the packed all-to-all gives the same answer."""
    config = ParallelConfig(machines=mesh[0], gpus_per_machine=mesh[1], method=method)
    for problem, pass_lens in problems(method, WORLD):
        results = pool.run(_run_rank_exchanging_by_all_to_all, config, problem, pass_lens)
        compare(config, problem, results)
