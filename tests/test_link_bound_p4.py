"""The cost model's link bound against what the emulated link counted: for one attention layer of every method
and layout on emulated 2 x 2 and 4 x 1 machines (gloo, 4 ranks), the bytes and messages the busiest rank sends
across machines are exactly the ones its transport posted, joint text tokens included (their all-gather share
padded to the longest, as the transport sends it); and bench's "x bound" is against the larger of the no-comm
bound and the link bound."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from streamfusion_diffusers import ParallelConfig, init_parallel, sp_attention
from streamfusion_diffusers.bench.command import _cases, run_tasks
from streamfusion_diffusers.bench.layer import Case, Setup, bench_layer, padded_length
from streamfusion_diffusers.bench.report import markdown
from streamfusion_diffusers.choice.costmodel import candidate_layouts, link_bound
from streamfusion_diffusers.choice.workloads import Workload, parse_workload
from streamfusion_diffusers.runtime.pool import ProcessPool
from streamfusion_diffusers.core.config import METHODS
from streamfusion_diffusers.core.links import parse_link
from streamfusion_diffusers.core.mesh import GroupCache

LINK = "p4de"
# 64 tokens (16 a rank) and 6 joint text tokens: a ring of 4 gathers 2 rows of each rank's share, one of them pad
W = Workload("link", tokens=64, text_tokens=6, heads=8, head_dim=16, blocks=1)
GROUPS = GroupCache()


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(4, timeout_s=120.0) as p:
        yield p


def _layouts(machines: int) -> list:
    return [lay for method in METHODS for lay in candidate_layouts(method, machines, 4 // machines, W.heads)]


def _counted_per_layout(machines: int) -> list[tuple[int, int, int, int]]:
    """This rank's (sent bytes, sent messages, received bytes, received messages) across machines in one
    sp_attention call of each layout."""
    g = torch.Generator().manual_seed(0)
    shape = (W.batch, W.tokens // 4, W.heads, W.head_dim)
    jshape = (W.batch, W.text_tokens, W.heads, W.head_dim)
    q, k, v = (torch.randn(shape, generator=g) for _ in range(3))
    jq, jk, jv = (torch.randn(jshape, generator=g) for _ in range(3))
    out = []
    for lay in _layouts(machines):
        config = ParallelConfig(machines=machines, gpus_per_machine=4 // machines, method=lay.method,
                                ulysses=lay.ulysses if lay.method not in ("ulysses", "ring") else None,
                                torus=lay.torus if lay.method == "torus" else None, emulate_link=LINK)
        ctx = init_parallel(config, groups=GROUPS)
        assert ctx.mesh(W.heads).layout == lay.placement  # the layout asked for, under its placement's name
        before = dataclasses.astuple(ctx.transport.counted)
        sp_attention(q, k, v, ctx, joint_q=jq, joint_k=jk, joint_v=jv)
        out.append(tuple(a - b for a, b in zip(dataclasses.astuple(ctx.transport.counted), before)))
    dist.barrier()
    return out


@pytest.mark.parametrize("machines", [2, 4])
def test_model_bytes_and_messages_are_what_the_transport_counted(pool, machines):
    link = parse_link(LINK)
    per_rank = pool.run(_counted_per_layout, machines)
    for i, lay in enumerate(_layouts(machines)):
        counted = [rank[i] for rank in per_rank]
        model = link_bound(lay, W, link, elem_bytes=4)
        busiest = max(counted, key=lambda c: link.seconds(c[0], c[1]))
        assert (model.bytes_per_gpu, model.messages) == (busiest[0], busiest[1]), (lay, counted)
        assert model.seconds == pytest.approx(link.seconds(busiest[0], busiest[1]), rel=1e-12)
        # what a rank sends another receives: the busiest receiver takes the link no longer than the sender
        assert max(link.seconds(c[2], c[3]) for c in counted) == pytest.approx(model.seconds, rel=1e-12)
        assert (model.bytes_per_gpu > 0) == (lay.ring > 1 or lay.ulysses_intra > 1 or lay.torus > 1)


@pytest.mark.parametrize("machines, link, larger", [(2, "1:2000", "link"), (4, "1000:0", "compute")])
def test_bench_x_bound_is_against_the_larger_bound(pool, machines, link, larger):
    """A slow link (2 ms a message) bounds every layout of ours above the compute; a fast one below it."""
    w = parse_workload("custom:250:6:8:16")  # padded to 256 with the text in the sequence, as bench's layer runs
    m = 4 // machines
    setup = Setup(w, machines, m, "torch", link, torch.float32, iters=1, warmup=0, seed=0, timeout_s=60.0)
    cases = [Case("bound")] + [c for meth in ("usp", "torus") for c in _cases(meth, "all", machines, m, w.heads,
                                                                              False, torch.float32)]
    rows = pool.run(run_tasks, [(bench_layer, setup, cases)])[0]
    compute = next(r["ms"] for r in rows if r["method"] == "bound")
    layouts = {lay.label: lay for meth in ("usp", "torus") for lay in candidate_layouts(meth, machines, m, w.heads)}
    as_run = dataclasses.replace(w, tokens=padded_length(w, 4), text_tokens=0)
    table = markdown(rows, "## t")
    for row in rows[1:]:
        expected = link_bound(layouts[row["layout"]], as_run, parse_link(link), elem_bytes=4).seconds * 1e3
        assert row["link_bound_ms"] == pytest.approx(expected, rel=1e-12), row
        assert (row["link_bound_ms"] > compute) == (larger == "link"), (row, compute)
        assert row["vs_bound"] == pytest.approx(row["ms"] / max(compute, row["link_bound_ms"]), rel=1e-12), row
        assert f"| {row['link_bound_ms']:.3f} | {row['vs_bound']:.2f} |" in table, table
    assert rows[0]["link_bound_ms"] is None and rows[0]["vs_bound"] == pytest.approx(1.0)
