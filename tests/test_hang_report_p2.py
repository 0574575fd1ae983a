"""A hang in a bench round ends within its deadline on every rank, each saying which transfer it waited for and
printing every thread's stack: rank 0 waits for a ring exchange that rank 1 never posts (gloo, two ranks)."""
from __future__ import annotations

import time

import pytest
import torch

from streamfusion_diffusers import ParallelConfig, init_parallel
from streamfusion_diffusers.backends.watchdog import EXIT_CODE
from streamfusion_diffusers.runtime.pool import ProcessPool, RankFailure
from streamfusion_diffusers.commands.timing import deadline

DEADLINE_S = 2.0


def _one_side_of_an_exchange() -> None:
    ctx = init_parallel(ParallelConfig(method="ring", timeout_s=120.0))  # the group outlasts the deadline
    mesh = ctx.mesh(None)
    with deadline(DEADLINE_S):
        if mesh.ring.index == 0:
            ctx.transport.begin_layer(0)
            x = torch.ones(8)
            ctx.transport.exchange([(x, 1)], [(torch.empty_like(x), 1)], mesh.ring).wait()
        else:
            time.sleep(60)  # never posts its side


def test_a_stuck_round_names_the_transfer_and_dumps_every_rank(capfd):
    start = time.monotonic()
    with ProcessPool(2, timeout_s=120.0) as pool, pytest.raises(RankFailure) as failed:
        pool.run(_one_side_of_an_exchange)
    took = time.monotonic() - start
    err = capfd.readouterr().err
    assert took < 30, took
    assert f"code {EXIT_CODE}" in str(failed.value) or "exited" in str(failed.value), failed.value
    assert "rank 0: nothing finished within 2 s" in err, err
    assert "the host waits for attention layer 1, ring pass from rank 1" in err, err
    assert "rank 1: nothing finished within 2 s" in err and "no attention transfer was pending" in err, err
    assert err.count("_one_side_of_an_exchange") >= 2, err  # both ranks' stacks
    lines = err.splitlines()
    for rank in (0, 1):  # each rank's stacks in one block of lines marked with it, right after its line
        at = next(i for i, line in enumerate(lines) if line.startswith(f"streamfusion: rank {rank}: nothing"))
        assert all(line.startswith(f"rank {rank}| ") for line in lines[at + 1:at + 6]), err
