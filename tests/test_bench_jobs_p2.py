"""A bench job with several workloads creates its process groups once (2 gloo processes): the second and third
workloads reuse the first one's groups, ours (one Mesh per layout) and yunchang's (xdit-usp), instead of
adding NCCL communicators, each initialized at its first collective, for every case of every workload."""
from __future__ import annotations

import pytest
import torch
from torch.distributed import distributed_c10d as c10d

from streamfusion_diffusers.bench import xdit
from streamfusion_diffusers.bench.layer import Case, Setup, bench_layer
from streamfusion_diffusers.choice.workloads import parse_workload
from streamfusion_diffusers.runtime.pool import ProcessPool
from streamfusion_diffusers.core.exactness import passes
from streamfusion_diffusers.core.mesh import GroupCache

CASES = [Case("bound"), Case("ulysses", 2, 1), Case("usp", 1, 2), Case("torus", 2, 1, 2)] + \
    ([Case("xdit-usp", 2, 1)] if xdit.available() else [])


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(2) as p:
        yield p


def groups_per_workload(specs: list[str]) -> list[int]:
    """Process groups each workload's bench_layer created on this rank; every row checked exact."""
    counts, groups = [], GroupCache()  # the job's, as bench's run_tasks holds it
    for spec in specs:
        before = c10d._world.group_count
        rows = bench_layer(Setup(parse_workload(spec), 1, 2, "torch", None, torch.float32, 1, 0, 0), CASES, groups)
        assert all(passes(r["rel_err"], torch.float32) for r in rows), rows
        counts.append(c10d._world.group_count - before)
    return counts


def test_later_workloads_create_no_process_groups(pool):
    counts = pool.run(groups_per_workload, ["custom:24:4:4:8", "custom:40:4:4:8", "custom:32:0:4:8"])
    assert all(c[0] > 0 and c[1:] == [0, 0] for c in counts), counts
