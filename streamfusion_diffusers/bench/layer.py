"""One attention layer, timed for every method and layout side by side in one job, beside its bounds.

Every rank draws the whole sequence from one seed, keeps its slice of Q, K, V, and times each method on it.
The no-communication bound is each rank's own share of the work with nothing moved: its L/P queries against
all L keys, through the same kernel. Over an emulated link, each of our layouts also has its link bound
(bound.py), and "x bound" is against the larger of the two. Every timed method is checked against softmax
attention written out in torch (exactness.py, an independent path: a kernel bug cannot agree with itself), by
the relative error of the whole output over every rank. The text tokens travel with the sequence here (as xDiT's USP layer takes
them), the whole sequence padded to a multiple of P.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from tqdm import tqdm

from .. import ParallelConfig, init_parallel, sp_attention
from ..choice.workloads import Workload
from ..commands.timing import deadline, interleaved_ms
from ..core.config import layout_label
from ..core.exactness import error_sums, ratio, reference_attention
from ..core.mesh import GroupCache
from .bound import fastest_attention, link_bound_ms, over_bounds
from .variants import graphed, suffix
from .xdit import XdiTUSP

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Case:
    """One timed variant: a method of ours, a baseline ("xdit-usp", "diffusers-cp") or the bound ("bound")."""

    method: str
    ulysses: int = 1
    ring: int = 1
    torus: int | None = None
    variant: str = "eager"  # how our layout runs (bench/variants.py): eager, cuda-graph, compile

    @property
    def name(self) -> str:
        """The method, with the variant when not eager (rows of one method and variant compete for "best")."""
        return self.method + suffix(self.variant)

    @property
    def label(self) -> str:
        if self.method in ("bound", "auto"):
            base = "no-comm bound" if self.method == "bound" else "auto"
        else:
            base = layout_label(self.method, self.ulysses, self.ring, self.torus)
        return f"{base} {suffix(self.variant)}" if self.variant != "eager" else base


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
    recipe: str | None = None  # where method "auto" looks for its layout (None: the packaged recipes)
    comm_dtype: str | None = None  # "fp8" / "int8": inter-machine chunks as 1-byte values (backends/quantized.py)
    kernel: str = "auto"  # the local attention kernel of our cases (tune records the one it timed)


def device_of_job() -> torch.device:
    """This rank's GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def padded_length(w: Workload, world: int) -> int:
    total = w.tokens + w.text_tokens
    return -(-total // world) * world


def bench_layer(setup: Setup, cases: list[Case], groups: GroupCache | None = None) -> list[dict]:
    """Run on every rank; one row per case: the slowest rank's min / median / max per call over samples that
    are interleaved across the cases (round-robin, commands/timing.py), after every case is set up and checked,
    and the worst rank's error against the exact rows. groups: the job's process groups, reused across
    workloads."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device, w, groups = device_of_job(), setup.workload, groups or GroupCache()
    length = padded_length(w, world)
    g = torch.Generator(device=device).manual_seed(setup.seed)
    shape = (w.batch, length, w.heads, w.head_dim)
    q_all, k, v = (torch.randn(shape, generator=g, device=device, dtype=setup.dtype) for _ in range(3))
    rows = slice(rank * length // world, (rank + 1) * length // world)
    q, k_loc, v_loc = q_all[:, rows].contiguous(), k[:, rows].contiguous(), v[:, rows].contiguous()
    del q_all
    ref = reference_attention(q, k, v)
    if device.type == "cuda":  # peak_gib is the cases' memory, not the float32 reference's
        torch.cuda.reset_peak_memory_stats(device)
    calls, errors, labels, links = [], [], [], []
    as_run = replace(w, tokens=length, text_tokens=0)  # the text travels with the sequence, padded to P slices
    for case in tqdm(cases, desc=f"{w.name}: set up", disable=rank != 0, leave=False):
        if case.method == "bound":
            bound = fastest_attention  # the fastest kernel without LSE for the share
            bound = graphed(bound) if case.variant == "cuda-graph" else bound
            calls.append(lambda bound=bound: bound(q, k, v))
            errors.append(_errors(bound(q, k, v).to(setup.dtype), ref))  # the kernel alone, checked as well
            labels.append(case.label)
            links.append(None)
            continue
        with deadline(setup.timeout_s):
            call, ctx = _callable(case, setup, device, groups)
            errors.append(_errors(call(q, k_loc, v_loc), ref))
            calls.append(lambda call=call: call(q, k_loc, v_loc))
            labels.append(auto_label(ctx) if case.method == "auto" else case.label)
            links.append(link_bound_ms(ctx, as_run, q.element_size()))
    worst = torch.tensor([e[0] for e in errors], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    # the whole output's relative error: squared norms summed over the ranks
    sums = torch.tensor([e[1] for e in errors] + [error_sums(ref, ref)[1]], dtype=torch.float64, device=device)
    dist.all_reduce(sums)
    rel = [ratio(diff, sums[-1].item()) for diff in sums[:-1].tolist()]
    stats = interleaved_ms(calls, setup.iters, setup.warmup, device, setup.timeout_s)
    bound_ms = {c.variant: s.median for c, s in zip(cases, stats) if c.method == "bound"}  # like with like
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return [dict(workload=w.name, level="layer", tokens=length, method=case.name, layout=name, **s.row(),
                 link_bound_ms=link, vs_bound=over_bounds(s.median, bound_ms.get(case.variant, bound_ms.get("eager")),
                                                          link),
                 max_abs_err=err, rel_err=r, peak_gib=peak)
            for case, name, s, link, err, r in zip(cases, labels, stats, links, worst.tolist(), rel)]


def _errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max abs difference, shown beside; squared norm of the difference, summed over ranks for rel_err)."""
    return (out.double() - ref.double()).abs().max().item(), error_sums(out, ref)[0]


def auto_label(ctx) -> str:
    """"auto (the layout it chose)" for a context of method "auto" that has run."""
    return "auto (" + ", ".join(sorted({c.layout.label for c in ctx.chosen.values()})) + ")"


def parallel_config(case: Case, setup: Setup) -> ParallelConfig:
    """The ParallelConfig of one of our cases on the setup's cluster and transport."""
    return ParallelConfig(machines=setup.machines, gpus_per_machine=setup.gpus_per_machine, method=case.method,
                          ulysses=case.ulysses if case.method not in ("ulysses", "ring", "auto") else None,
                          torus=case.torus, backend=setup.backend, emulate_link=setup.emulate_link,
                          recipe=setup.recipe, comm_dtype=setup.comm_dtype, timeout_s=setup.timeout_s,
                          kernel=setup.kernel)


def _callable(case: Case, setup: Setup, device: torch.device, groups: GroupCache):
    """The case's attention call, and our context for it (None for xDiT), on the job's process groups."""
    if case.method == "xdit-usp":
        return XdiTUSP(case.ulysses, case.ring, device, groups), None
    ctx = init_parallel(parallel_config(case, setup), groups=groups)
    call = lambda q, k, v: sp_attention(q, k, v, ctx)  # noqa: E731
    return (graphed(call) if case.variant == "cuda-graph" else call), ctx
