"""Ranks that disagree on sp_attention's inputs all raise one ValueError naming the ranks and the fix (4 gloo
processes); the job goes on afterwards, and a signature that agreed once is not checked again."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from sp_cases import Problem, check, context

from streamfusion_diffusers import ParallelConfig, sp_attention
from streamfusion_diffusers.attention import agreement
from streamfusion_diffusers.runtime.pool import ProcessPool

WORLD = 4
CONFIGS = [ParallelConfig(machines=1, gpus_per_machine=4, method="ulysses"),
           ParallelConfig(machines=2, gpus_per_machine=2, method="torus")]


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(WORLD, timeout_s=60) as p:
        yield p


def call_with(config: ParallelConfig, odd_rank: int, change: str) -> tuple[str, float]:
    """sp_attention where `odd_rank` changes one thing (`change`); returns (error message, seconds taken)."""
    rank = dist.get_rank()
    b, n, heads, d, dtype, joint, lens = 1, 8, 4, 16, torch.float32, 4, None
    if rank == odd_rank:
        if change == "slice":
            n = 9
        elif change == "heads":
            heads = 8
        elif change == "dtype":
            dtype = torch.float64
        elif change == "joint":
            joint = 5
        elif change == "own-seq-lens":
            lens = [8, 9, 8, 8]
    if change == "wrong-seq-lens":
        lens = [8, 8, 8, 9] if rank == odd_rank else [8] * WORLD
    q, k, v = (torch.randn(b, n, heads, d, dtype=dtype) for _ in range(3))
    jq, jk, jv = (torch.randn(b, joint, heads, d, dtype=dtype) for _ in range(3))
    start = time.monotonic()
    try:
        sp_attention(q, k, v, context(config), joint_q=jq, joint_k=jk, joint_v=jv, seq_lens=lens)
    except ValueError as err:
        return str(err), time.monotonic() - start
    return "no error", time.monotonic() - start


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.method)
def test_a_different_slice_length_is_refused_on_every_rank(pool, config):
    results = pool.run(call_with, config, 2, "slice")
    for message, seconds in results:
        assert "slice lengths differ (8 on ranks [0, 1, 3], 9 on rank [2])" in message, message
        assert "pass seq_lens=[8, 8, 9, 8]" in message, message
        assert seconds < 30
    check(pool, config, Problem(4, 16, 1, (8, 8, 9, 8), joint=4))  # the job goes on, and seq_lens fixes it


@pytest.mark.parametrize("change, expected", [
    ("heads", "heads differs (4 on ranks [0, 1, 3], 8 on rank [2]): ranks [2] disagree"),
    ("dtype", "dtype differs (torch.float32 on ranks [0, 1, 3], torch.float64 on rank [2])"),
    ("joint", "joint length differs (4 on ranks [0, 1, 3], 5 on rank [2])"),
    ("wrong-seq-lens", "seq_lens on rank(s) [2] does not match the slice lengths the ranks hold: pass "
                       "seq_lens=[8, 8, 8, 8] on every rank"),
])
def test_any_disagreement_names_the_ranks(pool, change, expected):
    results = pool.run(call_with, CONFIGS[1], 2, change)
    assert all(expected in message for message, _ in results), results


def test_a_local_refusal_reaches_every_rank(pool):
    messages = [m for m, _ in pool.run(call_with, CONFIGS[1], 1, "own-seq-lens")]
    assert "rank 1 holds 8 tokens but seq_lens[1] = 9" in messages[1], messages
    assert all("rank(s) [1] refused their inputs" in m for i, m in enumerate(messages) if i != 1), messages


def gathers_in_repeated_calls(config: ParallelConfig, calls: int) -> int:
    """How many agreement gathers `calls` identical sp_attention calls make (a new shape each test run)."""
    original, count = agreement._gather, []

    def counting(*args):
        count.append(1)
        return original(*args)

    agreement._gather = counting
    try:
        x = torch.randn(1, 11, 4, 16)
        for _ in range(calls):
            sp_attention(x, x, x, context(config))
    finally:
        agreement._gather = original
    return len(count)


def test_the_check_runs_once_per_signature(pool):
    assert pool.run(gathers_in_repeated_calls, CONFIGS[0], 3) == [1] * WORLD
