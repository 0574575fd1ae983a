"""One process (mesh 1x1) for every method; several layouts in one job; errors raised at run time (4 ranks)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from attention_suite import METHODS, problems
from sp_cases import TOL, Problem, check, context, even, reference, run_rank

from streamfusion_diffusers import ParallelConfig, init_parallel, sp_attention
from streamfusion_diffusers.runtime.pool import ProcessPool
from streamfusion_diffusers.attention import layer
from streamfusion_diffusers.core.exactness import reference_attention, relative_error


@pytest.fixture(scope="module")
def pool():
    with ProcessPool(1) as p:
        yield p


@pytest.fixture(scope="module")
def pool4():
    with ProcessPool(4) as p:
        yield p


@pytest.mark.parametrize("method", METHODS)
def test_single_rank(pool, method):
    for problem, pass_lens in problems(method, 1):
        check(pool, ParallelConfig(method=method), problem, pass_lens)


def _strided_inputs_reach_the_kernel_as_they_lie(kernel: str) -> dict:
    """At P = 1, q, k, v cut from one fused projection (Flux.2's single blocks: QKV and MLP in one matmul, so each
    is a strided view): the error against the reference, whether the kernel got the very views (no copy), and
    whether the output is diffusers' own (torch's SDPA, as its native backend calls it), bit for bit."""
    fused = torch.randn(2, 10, 3 * 4 * 8 + 16, dtype=torch.float64)
    q, k, v = (x.unflatten(-1, (4, 8)) for x in fused[..., :96].chunk(3, dim=-1))
    seen: list[int] = []

    def spy(partials, q_chunks, kv_chunks, *args, **kwargs):
        seen.extend(t.data_ptr() for t in (q_chunks[0], *kv_chunks[0]))
        return real(partials, q_chunks, kv_chunks, *args, **kwargs)

    real, layer.attend_chunks = layer.attend_chunks, spy
    try:
        out = sp_attention(q, k, v, context(ParallelConfig(method="ulysses", kernel=kernel)))
    finally:
        layer.attend_chunks = real
    native = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
    return {"error": relative_error(out, reference_attention(q, k, v)), "strided": not v.is_contiguous(),
            "as_they_lie": seen == [q.data_ptr(), k.data_ptr(), v.data_ptr()], "as_diffusers": torch.equal(out, native)}


@pytest.mark.parametrize("kernel", ["auto", "sdpa"])
def test_one_rank_moves_nothing(pool, kernel):
    """At P = 1 nothing moves, so no layout copy either (Flux.2-dev's single blocks would pay one each);
    the sdpa kernel is then diffusers' own call, bit for bit (on a GPU "auto" times it against the fused kernel:
    tests/test_kernels_gpu.py)."""
    res = pool.run(_strided_inputs_reach_the_kernel_as_they_lie, kernel)[0]
    assert res["strided"] and res["as_they_lie"] and res["error"] <= TOL, res
    assert res["as_diffusers"] or kernel != "sdpa", res


def _all_methods_in_one_job(problem: Problem) -> dict[str, torch.Tensor]:
    """Five contexts live side by side, called interleaved, as a comparison run would use them."""
    configs = {m: ParallelConfig(machines=2, gpus_per_machine=2, method=m) for m in METHODS}
    return {m: run_rank(c, problem)[0] for m, c in configs.items()}


def test_several_contexts_in_one_job(pool4):
    problem = Problem(8, 16, 1, even(5, 4))
    ref, _ = reference(problem)
    results = pool4.run(_all_methods_in_one_job, problem)
    for method in METHODS:
        got = torch.cat([r[method] for r in results], dim=1)
        assert relative_error(got, ref) <= TOL, method


def _error(kind: str) -> str:
    """Trigger one misuse on every rank and return the message it raised."""
    x = torch.randn(1, 3, 6, 8)
    try:
        if kind == "world":
            init_parallel(ParallelConfig(machines=2, gpus_per_machine=4))
        elif kind == "heads":
            sp_attention(x, x, x, context(ParallelConfig(method="ulysses")))
        elif kind == "torus":
            config = ParallelConfig(machines=2, gpus_per_machine=2, method="torus", ulysses=2, torus=4)
            sp_attention(x, x, x, context(config))
        elif kind == "seq_lens":
            sp_attention(x, x, x, context(ParallelConfig(method="ring")), seq_lens=[3, 3, 3])
        elif kind == "slice":
            sp_attention(x, x, x, context(ParallelConfig(method="ring")), seq_lens=[4, 4, 4, 4])
        elif kind == "joint":
            sp_attention(x, x, x, context(ParallelConfig(method="ring")), joint_q=x)
        elif kind == "backend":
            init_parallel(ParallelConfig(backend="nccl"))
    except ValueError as err:
        return str(err)
    finally:
        dist.barrier()
    return "no error"


@pytest.mark.parametrize("kind, words", [
    ("world", ["world size 4", "2 x 4"]),
    ("heads", ["does not divide the 6 heads", "[1, 2]", "'usp', 'tas' or 'torus'"]),
    ("torus", ["torus degree 4 does not divide ulysses degree 2", "[1, 2]"]),
    ("seq_lens", ["4 non-negative slice lengths"]),
    ("slice", ["holds 3 tokens but seq_lens"]),
    ("joint", ["joint_q, joint_k and joint_v together"]),
    ("backend", ["runs 'gloo'"]),
])
def test_errors_name_the_fix(pool4, kind, words):
    for message in pool4.run(_error, kind):
        for word in words:
            assert word in message, message
