"""The "auto" kernel choice is the same on every rank of a layer (4 gloo processes fed per-rank fake timings):
each call position takes the kernel whose slowest rank is fastest, in one gather at the end of the first call of
a layer signature, and later calls of that signature choose without any collective."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from sp_cases import context

from streamfusion_diffusers import ParallelConfig, sp_attention
from streamfusion_diffusers.runtime.pool import ProcessPool
from streamfusion_diffusers.core.mesh import Group
from streamfusion_diffusers.kernels import dispatch

WORLD = 4
# FAKE_MS[position][rank]: (sdpa ms, fused ms), or None where that rank's call makes no choice (empty chunks)
FAKE_MS = [
    [(1.0, 2.5), (2.0, 2.5), (3.0, 2.5), (4.0, 2.5)],  # ranks 0, 1 prefer sdpa; its slowest rank (4.0) loses
    [(1.0, 0.5), (1.0, 0.5), (1.0, 3.0), (1.0, 0.5)],  # all but rank 2 prefer fused; fused's slowest (3.0) loses
    [(2.0, 1.0), None, None, None],  # only rank 0 chooses here: the others follow it
    [None, None, None, None],  # no rank chooses: nothing to agree on
]
AGREED = ["fused", "sdpa", "fused", None]
_signatures = itertools.count()  # a fresh layer signature per test, the same on every rank


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(WORLD, timeout_s=60) as p:
        yield p


def layer_calls(signature: int, world: bool) -> tuple[list[str | None], list[str | None], int]:
    """Two calls of one layer signature with this rank's fake times: (choices of call 1, of call 2, gathers);
    world=False runs the layer on this rank alone."""
    rank = dist.get_rank()
    group = Group(tuple(range(WORLD)), rank, None, "world") if world else Group((rank,), 0, None, "alone")
    timer, gather, gathers = dispatch.time_ms, dispatch._gather, []

    def counting(*args):
        gathers.append(1)
        return gather(*args)

    dispatch.time_ms = lambda prepare, run: prepare()  # a candidate's "time" is what its prepare returns
    dispatch._gather = counting
    try:
        runs = []
        for _ in range(2):
            chosen = []
            with dispatch.layer(signature, group):
                for position, per_rank in enumerate(FAKE_MS):
                    dispatch.count_call()
                    if per_rank[rank] is None:
                        chosen.append(None)
                        continue
                    # this rank's own chunk lengths: signatures differ between ranks, as with uneven splits
                    key = (signature, position, rank)
                    chosen.append(dispatch.choose(key, lambda: {name: (lambda ms=ms: ms, None)
                                                                for name, ms in zip(dispatch.KERNELS, per_rank[rank])}))
            runs.append(chosen)
    finally:
        dispatch.time_ms, dispatch._gather = timer, gather
    return runs[0], runs[1], len(gathers)


def own_pick(times: tuple[float, float] | None) -> str | None:
    return None if times is None else dispatch.KERNELS[times.index(min(times))]


def test_every_rank_takes_the_kernel_whose_slowest_rank_is_fastest(pool):
    results = pool.run(layer_calls, next(_signatures), True)
    for rank, (first, second, gathers) in enumerate(results):
        assert first == [own_pick(per_rank[rank]) for per_rank in FAKE_MS]  # before agreeing: its own pick
        assert second == [a if per_rank[rank] else None for a, per_rank in zip(AGREED, FAKE_MS)]
        assert gathers == 1  # the first call gathers once; the second, same signature, not at all


def test_a_rank_alone_keeps_its_own_pick_without_a_collective(pool):
    for rank, (first, second, gathers) in enumerate(pool.run(layer_calls, next(_signatures), False)):
        assert first == second == [own_pick(per_rank[rank]) for per_rank in FAKE_MS]
        assert gathers == 0


def gathers_in_cpu_attention() -> int:
    """Agreement gathers made by a CPU sp_attention call ("auto" is the reference kernel there: nothing to agree)."""
    gather, gathers = dispatch._gather, []
    dispatch._gather = lambda *args: gathers.append(1) or gather(*args)
    try:
        x = torch.randn(1, 8, 4, 64, dtype=torch.bfloat16)  # a shape the fused kernel takes on a GPU
        sp_attention(x, x, x, context(ParallelConfig(machines=1, gpus_per_machine=WORLD, method="ring")))
    finally:
        dispatch._gather = gather
    return len(gathers)


def test_cpu_attention_adds_no_collective(pool):
    assert pool.run(gathers_in_cpu_attention) == [0] * WORLD
