"""Where one attention layer's time goes: ours beside xDiT's USP, each under torch.profiler after warm-up.

    python -m torch.distributed.run --nproc-per-node 2 benchmarks/profile_layer.py \
        --workloads flux-2048,flux-4096 --cases ulysses,xdit-usp

Cases: any of our methods (ParallelConfig.method, on --backend) and "xdit-usp" (yunchang's USP at U = P, R = 1,
as bench runs it). Rank 0 prints one row per case, every figure in ms per layer: the wall time (CUDA events,
interleaved with the other cases, median of the slowest rank); the GPU's busy time (the union of every kernel's
interval on any stream: wall - busy is time no kernel ran, host gaps and launch latency); the attention
kernels' time and wall - attention (what the layer spends beyond attention); the communication, copy and
elementwise, and other kernels' time (summed over streams: with attention they can exceed busy where transfers
overlap compute); the host time to issue one call; the largest difference from the xDiT case's output.
Then each case's top kernels.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from streamfusion_diffusers import ParallelConfig, init_parallel, shutdown, sp_attention
from streamfusion_diffusers.bench.xdit import XdiTUSP
from streamfusion_diffusers.commands.timing import interleaved_ms
from streamfusion_diffusers.core.mesh import GroupCache
from streamfusion_diffusers.core.sequence import split_sizes

WORKLOADS = {"flux-1024": (4096 + 512, 24, 128), "flux-2048": (16384 + 512, 24, 128),
             "flux-4096": (65536 + 512, 24, 128), "cogvideox-49f": (17776 + 226, 48, 64)}
KINDS = [  # (kind, substrings of kernel names), first match wins
    ("attention", ("attention", "fmha", "flash", "sdpa", "cudnn", "_attn", "multi_chunk")),
    ("comm", ("nccl", "nvshmem", "barrier", "signal", "p2p", "ptop", "memcpy peer")),
    ("copy+ew", ("copy", "cat", "memcpy", "memset", "elementwise", "reduce", "fill", "index", "merge", "stack")),
]
COLUMNS = ["wall", "busy", "attention", "wall-attn", "comm", "copy+ew", "other", "host"]


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def busy_ms(kernels: list) -> float:
    """Length of the union of the kernels' [start, end] intervals (µs in, ms out)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted((e.time_range.start, e.time_range.end) for e in kernels):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1e3


def host_ms(call, device: torch.device, reps: int = 5) -> float:
    """Median host time to issue one call onto an idle GPU."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize(device)
    return statistics.median(times)


def profiled(call, iters: int, device: torch.device) -> tuple[dict[str, float], list[tuple[float, str]]]:
    """Per layer: busy and per-kind GPU ms; and (ms, name) of the kernels, slowest first."""
    dist.barrier()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize(device)
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    row = {"busy": busy_ms(kernels) / iters, **{kind: 0.0 for kind, _ in KINDS}, "other": 0.0}
    per_name: dict[str, float] = {}
    for e in kernels:
        ms = (e.time_range.end - e.time_range.start) / 1e3 / iters
        row[kind_of(e.name)] += ms
        per_name[e.name] = per_name.get(e.name, 0.0) + ms
    return row, sorted(((ms, name) for name, ms in per_name.items()), reverse=True)


def cases_of(names: list[str], args, heads: int, device: torch.device) -> list[tuple[str, object]]:
    """(label, attention call (q, k, v, lens) -> out) per case name."""
    world, out = dist.get_world_size(), []
    for name in names:
        if name == "xdit-usp":
            usp = XdiTUSP(world, 1, device, GroupCache())
            out.append((f"xdit-usp U{world}R1", lambda q, k, v, lens, usp=usp: usp(q, k, v)))
            continue
        ctx = init_parallel(ParallelConfig(method=name, backend=args.backend, kernel=args.kernel))
        lay = ctx.layout(heads)
        label = str(lay).replace(f" {lay.machines}x{lay.gpus_per_machine}", "")
        out.append((label, lambda q, k, v, lens, ctx=ctx: sp_attention(q, k, v, ctx, seq_lens=lens)))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="flux-2048,flux-4096", help=f"comma list of {sorted(WORKLOADS)}")
    parser.add_argument("--cases", default="ulysses,xdit-usp", help="comma list: our methods and/or xdit-usp")
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--kernel", default="auto")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--top", type=int, default=3, help="kernels listed per case")
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    if rank == 0:
        print(f"{'workload':<10} {'case':<20}" + "".join(f"{c:>10}" for c in COLUMNS) + f"{'max|d|':>9}"
              + f"   (ms per layer, {world} GPUs, {args.backend})")
    for workload in args.workloads.split(","):
        length, heads, dim = WORKLOADS[workload]
        lens = split_sizes(length, world)
        g = torch.Generator(device=device).manual_seed(rank)
        q, k, v = (torch.randn((1, lens[rank], heads, dim), generator=g, device=device, dtype=torch.bfloat16)
                   for _ in range(3))
        cases = cases_of(args.cases.split(","), args, heads, device)
        calls = [lambda call=call: call(q, k, v, lens) for _, call in cases]
        outs = [call() for call in calls]
        ref = next((o for (label, _), o in zip(cases, outs) if label.startswith("xdit")), None)
        walls = interleaved_ms(calls, args.iters, 3, device)
        for (label, _), call, wall, out in zip(cases, calls, walls, outs):
            row, top = profiled(call, args.iters, device)
            row.update(wall=wall.median, host=host_ms(call, device))
            row["wall-attn"] = row["wall"] - row["attention"]
            diff = "-" if ref is None or out is ref else f"{(out.float() - ref.float()).abs().max().item():.1e}"
            if rank == 0:
                print(f"{workload:<10} {label:<20}" + "".join(f"{row[c]:10.3f}" for c in COLUMNS) + f"{diff:>9}")
                for ms, name in top[:args.top]:
                    print(f"{'':>33}{ms:8.3f}  {name[:78]}")
    shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
