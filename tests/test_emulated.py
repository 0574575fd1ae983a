"""The emulated inter-machine link: slow across virtual machines, untouched inside one, queued, and exact."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from sp_cases import Problem, check, context, uneven

from streamfusion_diffusers import ParallelConfig
from streamfusion_diffusers.runtime.pool import ProcessPool

LINK_GBPS = 0.01  # 10 MB/s: 2 MB take 200 ms, far above gloo's own time on loopback, however loaded the machine
NBYTES = 2_000_000


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(4) as p:
        yield p


def _timed_exchanges(peer_offset: int, repeats: int) -> float:
    """Seconds for `repeats` back-to-back exchanges with rank (rank +- peer_offset) on the ring group."""
    ctx = context(ParallelConfig(machines=2, gpus_per_machine=2, method="ring", emulate_link=f"{LINK_GBPS}:0"))
    mesh = ctx.mesh(None)
    me = mesh.ring.index
    peer = me ^ peer_offset  # ring group = world here: 0<->1 inside machine 0, 0<->2 across
    x = torch.ones(NBYTES // 4)
    buf = torch.empty_like(x)
    dist.barrier()
    start = time.perf_counter()
    handles = [ctx.transport.exchange([(x, peer)], [(buf, peer)], mesh.ring) for _ in range(repeats)]
    for h in handles:
        h.wait()
    return time.perf_counter() - start


def test_inter_machine_transfers_take_the_link_time_and_queue(pool):
    one = NBYTES / (LINK_GBPS * 1e9)
    across = max(pool.run(_timed_exchanges, 2, 1))
    queued = max(pool.run(_timed_exchanges, 2, 3))
    inside = max(pool.run(_timed_exchanges, 1, 3))
    assert one <= across < 2 * one, across  # the link's time paid once
    assert 3 * one <= queued, queued
    assert inside < one, inside  # three transfers inside a machine still beat one across


@pytest.mark.parametrize("method", ["usp", "tas", "torus"])
def test_results_stay_exact(pool, method):
    config = ParallelConfig(machines=2, gpus_per_machine=2, method=method, ulysses=2, emulate_link="p4de")
    check(pool, config, Problem(6, 32, 1, uneven(23, 4, 7), joint=5))


def test_bad_link_names_presets():
    with pytest.raises(ValueError, match="neither a preset"):
        ParallelConfig(emulate_link="infiniband")
