"""`streamfusion verify`: every method against single-process attention on this cluster, with timings.

Run it before a long job: it spawns a local job (gloo on the CPU, or NCCL when there is a GPU per process),
or joins the running one under torchrun, and exits non-zero if any method disagrees with the reference.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import ParallelConfig, init_parallel, sp_attention
from .config import METHODS, resolve_layout
from .mesh import GroupCache
from .kernels import attention_with_lse_reference
from .sequence import split_sizes
from .timing import median_ms
from .spawn import job_shape, run_job

TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
LOWP_REL_TOLERANCE = 5e-2  # fp8 e4m3 rounds each transferred element by up to 2^-4 (about 2.5 % rms)
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
    parser.add_argument("--iters", type=int, default=3, help="timed calls per method after one warm-up call")
    parser.add_argument("--seed", type=int, default=None, help="input seed (default: fresh)")
    parser.add_argument("--cpu", action="store_true", help="spawn gloo processes on the CPU even if GPUs exist")


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, budget_bytes: int = 2**31) -> torch.Tensor:
    """float32 (float64 for float32 inputs) attention, a few heads at a time to bound the score matrix."""
    dtype = torch.float64 if q.dtype == torch.float32 else torch.float32
    heads_per_call = max(1, budget_bytes // (q.shape[0] * q.shape[1] * k.shape[1] * 8))
    outs = [attention_with_lse_reference(q[:, :, h:h + heads_per_call].to(dtype),
                                         k[:, :, h:h + heads_per_call].to(dtype),
                                         v[:, :, h:h + heads_per_call].to(dtype), q.shape[-1] ** -0.5)[0]
            for h in range(0, q.shape[2], heads_per_call)]
    return torch.cat(outs, dim=2)


def _verify_rank(configs: list[ParallelConfig], w: Workload) -> list[dict]:
    """Run every config on this rank; returns the rows, with error and time as maxima over ranks."""
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
    fk, fv = torch.cat([jk, k], dim=1), torch.cat([jv, v], dim=1)
    ref = _reference(torch.cat([jq, q[:, rows]], dim=1), fk, fv)
    joint = dict(joint_q=jq, joint_k=jk, joint_v=jv) if w.joint else {}
    table, groups = [], GroupCache()  # one set of process groups for every config
    for config in configs:
        ctx = init_parallel(config, groups=groups)
        layout = str(ctx.layout(w.heads))
        call = lambda: sp_attention(q[:, rows], k[:, rows], v[:, rows], ctx, seq_lens=lens, **joint)  # noqa: E731
        res = call()
        out, jout = res if w.joint else (res, jq[:, :0])
        err = max((out.float() - ref[:, w.joint:].float()).abs().max().item(),
                  (jout.float() - ref[:, : w.joint].float()).abs().max().item() if w.joint else 0.0)
        ms = median_ms(call, w.iters, 0, device)
        worst = torch.tensor([err], dtype=torch.float64, device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        table.append(dict(method=config.method, layout=layout, max_err=worst.item(), ms=ms,
                          ok=worst.item() <= TOLERANCE[w.dtype]))
    return table


def _print(table: list[dict], w: Workload, world: int, where: str) -> None:
    print(f"streamfusion verify: {world} ranks, {where}; B={w.batch} L={w.seq_len} (+{w.joint} joint) "
          f"H={w.heads} D={w.head_dim} {str(w.dtype).removeprefix('torch.')}, tolerance {TOLERANCE[w.dtype]:g}")
    print(f"{'method':<8} {'layout':<22} {'max abs err':>11} {'median ms':>10}  result")
    for row in table:
        print(f"{row['method']:<8} {row['layout']:<22} {row['max_err']:>11.2e} {row['ms']:>10.2f}  "
              f"{'ok' if row['ok'] else 'MISMATCH'}")


def main(args: argparse.Namespace) -> int:
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
                 seed=args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little"), iters=args.iters)
    table = run_job(_verify_rank, world, configs, w, gpu=gpu)[0]
    if int(os.environ.get("RANK", 0)) == 0:
        _print(table, w, world, "NCCL on GPUs" if gpu else "gloo on the CPU")
    return 0 if all(row["ok"] for row in table) else 1

