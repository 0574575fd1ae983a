"""Every method and layout of one attention layer runs to the end on emulated machines over the torch transport
(gloo here, 4 ranks: 2 x 2 and 4 x 1), exact, in one bench job, as `bench --emulate-link` runs them."""
from __future__ import annotations

import pytest
import torch

from streamfusion_diffusers.bench.command import _cases, run_tasks
from streamfusion_diffusers.bench.layer import Case, Setup, bench_layer
from streamfusion_diffusers.choice.workloads import parse_workload
from streamfusion_diffusers.runtime.pool import ProcessPool
from streamfusion_diffusers.core.exactness import threshold

METHODS = ("ulysses", "ring", "usp", "tas", "torus")


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(4, timeout_s=120.0) as p:
        yield p


@pytest.mark.parametrize("machines", [2, 4])
def test_every_method_and_layout_finishes_exact(pool, machines):
    w = parse_workload("custom:250:6:8:16")  # uneven slices (256 padded over 4) and text tokens
    m = 4 // machines
    setup = Setup(w, machines, m, "torch", "p4de", torch.float32, iters=1, warmup=1, seed=0, timeout_s=60.0)
    cases = [Case("bound")] + [c for meth in METHODS for c in _cases(meth, "all", machines, m, w.heads, False,
                                                                      torch.float32)]
    rows = pool.run(run_tasks, [(bench_layer, setup, cases)])[0]
    assert len(rows) == len(cases)
    assert any(r["method"] == "torus" and not r["layout"].endswith("T1") for r in rows), rows  # stages ran
    for row in rows:
        assert row["rel_err"] <= threshold(torch.float32), row
        assert row["ms"] > 0, row
