"""`streamfusion verify`: every method against single-process attention on this cluster, with timings.

Run it before a long job: it spawns a local job (gloo on the CPU, or NCCL when there is a GPU per process),
or joins the running one under torchrun, and exits non-zero if any method disagrees with the reference
(exactness.py: relative error against softmax attention written out in torch, per-dtype thresholds).
`--self-test` then runs every method again with each deliberate fault that applies to its layout (a ring
block dropped, the text keys dropped, a block counted twice, one rank's rows shifted) and fails unless the
same check catches every one: proof that the check can fail at the size it ran.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import ParallelConfig, init_parallel, sp_attention
from ..attention.faults import FAULTS, Exact
from ..core.config import METHODS, resolve_layout
from ..core.exactness import passes, reference_attention, relative_error, threshold
from ..core.mesh import GroupCache
from ..core.sequence import split_sizes
from ..runtime.run import job_shape, run_job
from .timing import median_ms

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Workload:
    batch: int
    seq_len: int
    joint: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    seed: int
    iters: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--machines", type=int, default=2, help="machines N (default 2)")
    parser.add_argument("--gpus-per-machine", type=int, default=None,
                        help="GPUs (processes) per machine M (default: 4 when spawning, world / N under torchrun)")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    parser.add_argument("--ulysses", type=int, default=None, help="Ulysses degree U (default gcd(P, heads))")
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--seq-len", type=int, default=None,
                        help="image/video tokens over all ranks (default 1024 on CPU, 16384 on GPU)")
    parser.add_argument("--joint", type=int, default=None, help="replicated text tokens (default 64 CPU, 512 GPU)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default float32 on CPU, bfloat16 on GPU")
    parser.add_argument("--iters", type=int, default=3, help="timed calls per method after the checked one")
    parser.add_argument("--no-timing", action="store_true", help="check (and --self-test) only, time nothing")
    parser.add_argument("--seed", type=int, default=None, help="input seed (default: fresh)")
    parser.add_argument("--cpu", action="store_true", help="spawn gloo processes on the CPU even if GPUs exist")
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds the whole check may take before the job is ended (default 1800)")
    parser.add_argument("--self-test", action="store_true",
                        help="then run every method with each deliberate fault that applies to its layout (ring "
                             "block dropped, text keys dropped, a block counted twice, one rank's rows shifted) "
                             "and exit non-zero unless the check catches every one")


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _verify_rank(configs: list[ParallelConfig], w: Workload, faults: Sequence[Exact]) -> list[dict]:
    """Run every config on this rank (then each applicable fault); returns the rows, relative errors over
    every rank's output rows, times as this rank's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = _device()
    seed = torch.tensor([w.seed], device=device)
    dist.broadcast(seed, 0)  # under torchrun every rank drew its own; rank 0's wins
    g = torch.Generator(device=device).manual_seed(int(seed.item()))
    shape = (w.batch, w.seq_len, w.heads, w.head_dim)
    q, k, v = (torch.randn(shape, generator=g, device=device, dtype=w.dtype) for _ in range(3))
    jshape = (w.batch, w.joint, w.heads, w.head_dim)
    jq, jk, jv = (torch.randn(jshape, generator=g, device=device, dtype=w.dtype) for _ in range(3))
    lens = split_sizes(w.seq_len, world)
    rows = slice(sum(lens[:rank]), sum(lens[: rank + 1]))
    ref = reference_attention(torch.cat([jq, q[:, rows]], dim=1), torch.cat([jk, k], dim=1), torch.cat([jv, v], dim=1))
    joint = dict(joint_q=jq, joint_k=jk, joint_v=jv) if w.joint else {}
    mine = [x[:, rows].contiguous() for x in (q, k, v)]
    del q, k, v

    def error(ctx) -> float:
        res = sp_attention(*mine, ctx, seq_lens=lens, **joint)
        out = torch.cat(res[::-1], dim=1) if w.joint else res  # [joint rows ; this rank's rows], as ref
        return relative_error(out, ref, distributed=True)

    table, groups = [], GroupCache()  # one set of process groups for every config
    for config in configs:
        ctx = init_parallel(config, groups=groups)
        layout = ctx.layout(w.heads)
        err = error(ctx)
        ms = median_ms(lambda: sp_attention(*mine, ctx, seq_lens=lens, **joint), w.iters, 0, device) \
            if w.iters else None
        faulty = {}  # each fault that applies: the relative error it made
        for fault in (f for f in faults if f.applies(layout, w.joint)):
            ctx.fault = fault
            try:
                faulty[fault.name] = error(ctx)
            finally:
                ctx.fault = None
        table.append(dict(method=config.method, layout=str(layout), rel_err=err, ms=ms,
                          ok=passes(err, w.dtype), faults=faulty))
    return table


def _print(table: list[dict], w: Workload, world: int, where: str) -> None:
    limit = threshold(w.dtype)
    print(f"streamfusion verify: {world} ranks, {where}; B={w.batch} L={w.seq_len} (+{w.joint} joint) "
          f"H={w.heads} D={w.head_dim} {str(w.dtype).removeprefix('torch.')}, relative error threshold {limit:.1e}")
    print(f"{'method':<8} {'layout':<22} {'rel err':>9} {'median ms':>10}  result")
    for row in table:
        ms = f"{row['ms']:>10.2f}" if row["ms"] is not None else f"{'-':>10}"
        print(f"{row['method']:<8} {row['layout']:<22} {row['rel_err']:>9.2e} {ms}  "
              f"{'ok' if row['ok'] else 'MISMATCH'}")
    for row in table:
        for name, err in row["faults"].items():
            what = (f"caught (rel err {err:.2e} > {limit:.1e})" if not passes(err, w.dtype) else
                    f"NOT CAUGHT (rel err {err:.2e} <= {limit:.1e})")
            print(f"self-test: {row['method']} {row['layout']}: {name}: {what}")


def main(args: argparse.Namespace, faults: Sequence[Exact] = FAULTS) -> int:
    """faults: what --self-test injects (tests pass their own)."""
    world, gpu = job_shape(args.machines * (args.gpus_per_machine or 4), args.cpu)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    configs = [ParallelConfig(machines=args.machines, gpus_per_machine=args.gpus_per_machine or world // args.machines,
                              method=m, ulysses=args.ulysses if m not in ("ulysses", "ring") else None)
               for m in methods]
    for config in configs:  # bad layouts fail here, before any process starts
        resolve_layout(config, world, args.heads)
    w = Workload(batch=args.batch, seq_len=args.seq_len or (16384 if gpu else 1024),
                 joint=args.joint if args.joint is not None else (512 if gpu else 64), heads=args.heads,
                 head_dim=args.head_dim, dtype=DTYPES[args.dtype] if args.dtype else
                 (torch.bfloat16 if gpu else torch.float32),
                 seed=args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little"), iters=0 if args.no_timing else args.iters)
    table = run_job(_verify_rank, world, configs, w, faults if args.self_test else (), gpu=gpu,
                    timeout_s=args.timeout)[0]
    if int(os.environ.get("RANK", 0)) == 0:
        _print(table, w, world, "NCCL on GPUs" if gpu else "gloo on the CPU")
    missed = [err for row in table for err in row["faults"].values() if passes(err, w.dtype)]
    return 0 if all(row["ok"] for row in table) and not missed else 1

