"""Where one attention layer's time goes: a torch.profiler breakdown of one method on this job's GPUs.

    streamfusion launch --nproc-per-node 2 --recipe flux-dev --resolution 2048 benchmarks/profile_layer.py \
        --workload flux-2048 --method torus --backend nvshmem

Rank 0 prints the layer's wall time (CUDA events, median), the GPU time of its kernels grouped by kind
(attention, merge/finalize arithmetic, copies and layout changes, communication and waits) and the top kernels.
GPU time summed over streams can exceed the wall time where transfers overlap attention; the gap between the
attention kernels' time and the wall time is what the schedule exposes.
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from streamfusion_diffusers import ParallelConfig, init_parallel, shutdown, sp_attention
from streamfusion_diffusers.bench.timing import median_ms
from streamfusion_diffusers.sequence import split_sizes

WORKLOADS = {"flux-2048": (16384 + 512, 24, 128), "flux-4096": (65536 + 512, 24, 128),
             "cogvideox-49f": (53040 + 226, 48, 64)}
KINDS = [  # (kind, substrings of kernel names), first match wins
    ("attention", ("attention", "fmha", "flash", "cudnn", "_attn", "sm90")),
    ("communication", ("nccl", "nvshmem", "barrier", "signal", "sleep", "memcpy peer", "p2p")),
    ("copy / layout", ("copy", "cat", "memcpy", "elementwise_kernel_with_index", "unrolled_elementwise")),
    ("merge / finalize", ("merge", "exp", "log", "mul", "add", "max", "div", "elementwise", "reduce")),
]


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="flux-2048")
    parser.add_argument("--method", default="torus")
    parser.add_argument("--backend", default="nvshmem")
    parser.add_argument("--kernel", default="auto")
    parser.add_argument("--machines", type=int, default=1)
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    ctx = init_parallel(ParallelConfig(machines=args.machines, method=args.method, backend=args.backend,
                                       kernel=args.kernel))
    rank, world = ctx.rank, ctx.world_size
    length, heads, dim = WORKLOADS[args.workload]
    lens = split_sizes(length, world)
    q, k, v = (torch.randn((1, lens[rank], heads, dim), device="cuda", dtype=torch.bfloat16) for _ in range(3))
    call = lambda: sp_attention(q, k, v, ctx, seq_lens=lens)  # noqa: E731
    wall = median_ms(call, args.iters, 3, torch.device("cuda", torch.cuda.current_device()))
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.iters):
            call()
        torch.cuda.synchronize()
    if rank == 0:
        per_kind: dict[str, float] = {}
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        for e in events:
            per_kind[kind_of(e.key)] = per_kind.get(kind_of(e.key), 0.0) + e.device_time_total / 1e3 / args.iters
        print(f"{args.workload} {ctx.layout(heads)} on {args.backend}: {wall:.3f} ms per layer (median, slowest rank)")
        for kind, ms in sorted(per_kind.items(), key=lambda x: -x[1]):
            print(f"  {kind:<17} {ms:8.3f} ms GPU time per layer")
        for e in sorted(events, key=lambda e: -e.device_time_total)[:8]:
            print(f"    {e.device_time_total / 1e3 / args.iters:8.3f} ms  x{e.count // args.iters:<3} {e.key[:90]}")
    shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
