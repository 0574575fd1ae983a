"""What a ParallelContext keeps (process groups, meshes, method "auto"'s choices, agreed shapes) lives on it and
is gone after shutdown(ctx); a context made with groups=ctx.groups reuses them instead of creating its own
(2 ranks)."""
from __future__ import annotations

import pytest
import torch

from streamfusion_diffusers import ParallelConfig, init_parallel, shutdown, sp_attention
from streamfusion_diffusers.commands.spawn import ProcessPool


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(2) as p:
        yield p


def _kept(ctx) -> dict[str, int]:
    return {"worlds": len(ctx.groups.worlds), "meshes": len(ctx.groups.meshes), "chosen": len(ctx.chosen),
            "agreed": len(ctx.agreed)}


def _run_then_shut_down() -> dict:
    ctx = init_parallel(ParallelConfig(method="auto"))
    other = init_parallel(ParallelConfig(method="ring"), groups=ctx.groups)
    x = torch.randn(1, 8, 4, 8)
    sp_attention(x, x, x, ctx)
    sp_attention(x, x, x, other)
    before = _kept(ctx)
    shared = other.groups is ctx.groups
    shutdown(ctx)
    return {"before": before, "after": _kept(ctx), "shared": shared}


def test_shutdown_empties_what_the_context_keeps(pool):
    for res in pool.run(_run_then_shut_down):
        assert res["shared"], res
        assert all(n > 0 for n in res["before"].values()), res
        assert all(n == 0 for n in res["after"].values()), res
