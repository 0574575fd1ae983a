"""One attention layer, timed for every method and layout side by side in one job, beside its bounds.

Every rank draws the whole sequence from one seed, keeps its slice of Q, K, V, and times each method on it.
The no-communication bound is each rank's own share of the work with nothing moved: its L/P queries against
all L keys, through the same kernel. That bound's output is also the exact answer for the rank's rows, so
every timed method is checked against it in the same run. The text tokens travel with the sequence here
(as xDiT's USP layer takes them), the whole sequence padded to a multiple of P.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tqdm import tqdm

from .. import ParallelConfig, init_parallel, sp_attention
from ..kernels import attention_with_lse
from .timing import deadline, median_ms
from .workloads import Workload
from .xdit import XdiTUSP

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Case:
    """One timed variant: a method of ours, a baseline ("xdit-usp", "diffusers-cp") or the bound ("bound")."""

    method: str
    ulysses: int = 1
    ring: int = 1
    torus: int | None = None

    @property
    def label(self) -> str:
        if self.method == "bound":
            return "no-comm bound"
        torus = f"T{self.torus}" if self.torus else ""
        return f"{self.method} U{self.ulysses}R{self.ring}{torus}"


@dataclass(frozen=True)
class Setup:
    """What every case shares: cluster shape, transport and the workload's inputs."""

    workload: Workload
    machines: int
    gpus_per_machine: int
    backend: str
    emulate_link: str | None
    dtype: torch.dtype
    iters: int
    warmup: int
    seed: int
    timeout_s: float = 300.0  # per case: a case that takes longer dumps every stack and exits
    comm_dtype: str | None = None  # "fp8": inter-machine chunks in FP8 (backends/fp8.py)


def device_of_job() -> torch.device:
    """This rank's GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def padded_length(w: Workload, world: int) -> int:
    total = w.tokens + w.text_tokens
    return -(-total // world) * world


def bench_layer(setup: Setup, cases: list[Case]) -> list[dict]:
    """Run on every rank; returns one row per case (times are the slowest rank's medians)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device, w = device_of_job(), setup.workload
    length = padded_length(w, world)
    g = torch.Generator(device=device).manual_seed(setup.seed)
    shape = (w.batch, length, w.heads, w.head_dim)
    q_all, k, v = (torch.randn(shape, generator=g, device=device, dtype=setup.dtype) for _ in range(3))
    rows = slice(rank * length // world, (rank + 1) * length // world)
    q, k_loc, v_loc = q_all[:, rows].contiguous(), k[:, rows].contiguous(), v[:, rows].contiguous()
    del q_all
    ref = attention_with_lse(q, k, v)[0].to(setup.dtype)
    bound_ms = median_ms(lambda: attention_with_lse(q, k, v), setup.iters, setup.warmup, device)
    table = []
    for case in tqdm(cases, desc=w.name, disable=rank != 0, leave=False):
        if case.method == "bound":
            ms, err, sq = bound_ms, 0.0, 0.0
        else:
            with deadline(setup.timeout_s):
                call = _callable(case, setup, device)
                out = call(q, k_loc, v_loc)
                err = (out.float() - ref.float()).abs().max().item()
                sq = (out.float() - ref.float()).pow(2).sum().item()
                ms = median_ms(lambda: call(q, k_loc, v_loc), setup.iters, setup.warmup, device)  # noqa: B023
        worst = torch.tensor([err], dtype=torch.float64, device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        sums = torch.tensor([sq, ref.float().pow(2).sum().item()], dtype=torch.float64, device=device)
        dist.all_reduce(sums)  # the whole output's relative error: squared norms summed over the ranks
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        table.append(dict(workload=w.name, level="layer", tokens=length, method=case.method, layout=case.label,
                          ms=ms, vs_bound=ms / bound_ms, max_abs_err=worst.item(),
                          rel_err=(sums[0] / sums[1]).sqrt().item(), peak_gib=peak))
    return table


def parallel_config(case: Case, setup: Setup) -> ParallelConfig:
    """The ParallelConfig of one of our cases on the setup's cluster and transport."""
    return ParallelConfig(machines=setup.machines, gpus_per_machine=setup.gpus_per_machine, method=case.method,
                          ulysses=case.ulysses if case.method not in ("ulysses", "ring") else None,
                          torus=case.torus, backend=setup.backend, emulate_link=setup.emulate_link,
                          comm_dtype=setup.comm_dtype)


def _callable(case: Case, setup: Setup, device: torch.device):
    if case.method == "xdit-usp":
        return XdiTUSP(case.ulysses, case.ring, device)
    ctx = init_parallel(parallel_config(case, setup))
    return lambda q, k, v: sp_attention(q, k, v, ctx)
