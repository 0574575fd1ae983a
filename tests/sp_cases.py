"""Shared pieces of the attention tests: random problems, the per-rank worker, and the exact reference.

Workers rebuild the inputs from a seed (cheap) and return only their own outputs; the test process computes
single-process attention once, in float64, and compares.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from streamfusion_diffusers import ParallelConfig, init_parallel, sp_attention
from streamfusion_diffusers.core.exactness import reference_attention, relative_error, threshold
from streamfusion_diffusers.core.mesh import GroupCache
from streamfusion_diffusers.core.sequence import split_sizes

TOL = threshold(torch.float32)  # relative error, float32 inputs against float64 softmax attention
GROUPS = GroupCache()  # this worker's process groups, shared by its contexts
_contexts: dict[ParallelConfig, object] = {}


@dataclass(frozen=True)
class Problem:
    heads: int
    head_dim: int
    batch: int
    seq_lens: tuple[int, ...]
    joint: int = 0
    seed: int = field(default_factory=lambda: random.SystemRandom().randrange(2**31))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """q, k, v over the whole sequence, then joint q, k, v (or Nones)."""
        g = torch.Generator().manual_seed(self.seed)
        shape = (self.batch, sum(self.seq_lens), self.heads, self.head_dim)
        qkv = tuple(torch.randn(shape, generator=g) for _ in range(3))
        jshape = (self.batch, self.joint, self.heads, self.head_dim)
        joint = tuple(torch.randn(jshape, generator=g) for _ in range(3)) if self.joint else (None,) * 3
        return qkv + joint


def uneven(length: int, world: int, seed: int) -> tuple[int, ...]:
    """Random positive slice lengths summing to `length` (a fresh uneven split)."""
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, length), world - 1)) if world > 1 else []
    return tuple(b - a for a, b in zip([0, *cuts], [*cuts, length]))


def even(per_rank: int, world: int) -> tuple[int, ...]:
    return tuple(split_sizes(per_rank * world, world))


def context(config: ParallelConfig):
    """One context per config per worker, reused across tests; they share their process groups."""
    if config not in _contexts:
        _contexts[config] = init_parallel(config, groups=GROUPS)
    return _contexts[config]


def run_rank(config: ParallelConfig, problem: Problem, pass_lens: bool = True):
    """This rank's sp_attention outputs for the problem: (local rows, joint rows or None)."""
    rank = dist.get_rank()
    q, k, v, jq, jk, jv = problem.tensors()
    start = sum(problem.seq_lens[:rank])
    rows = slice(start, start + problem.seq_lens[rank])
    lens = list(problem.seq_lens) if pass_lens else None
    ctx = context(config)
    res = sp_attention(q[:, rows], k[:, rows], v[:, rows], ctx, joint_q=jq, joint_k=jk, joint_v=jv, seq_lens=lens)
    return res if isinstance(res, tuple) else (res, None)


def reference(problem: Problem) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Single-process attention over [joint ; sequence] in float64: (sequence rows, joint rows)."""
    q, k, v, jq, jk, jv = problem.tensors()
    if problem.joint:
        q, k, v = (torch.cat([j, x], dim=1) for j, x in ((jq, q), (jk, k), (jv, v)))
    out = reference_attention(q, k, v)
    return out[:, problem.joint:], (out[:, : problem.joint] if problem.joint else None)


def check(pool, config: ParallelConfig, problem: Problem, pass_lens: bool = True) -> None:
    """Run the problem on every rank of the pool and compare with the reference; fails with the seed."""
    compare(config, problem, pool.run(run_rank, config, problem, pass_lens))


def compare(config: ParallelConfig, problem: Problem, results: list) -> None:
    """Every rank's run_rank result against the single-process reference."""
    ref, ref_joint = reference(problem)
    got = torch.cat([out for out, _ in results], dim=1)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    err = relative_error(got, ref)
    assert err <= TOL, f"{config} {problem}: relative error {err:.2e} > {TOL:.1e}"
    if problem.joint:
        for rank, (_, joint) in enumerate(results):
            jerr = relative_error(joint, ref_joint)
            assert jerr <= TOL, f"{config} {problem}: joint rows on rank {rank} off by {jerr:.2e} (relative)"
