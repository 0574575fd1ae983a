"""One attention layer on the GPUs of one host, NCCL against NVSHMEM: checks first, then times (issue 4).

    python -m streamfusion_diffusers launch --nproc-per-node 8 --recipe flux-dev --resolution 4096 \
        benchmarks/layer_bench.py --out "$OUT"

1. Check: every method on both transports against float32 softmax attention (exactness.py: relative error
   over every rank's rows; uneven slices, joint tokens), on every machine shape N x (P/N) with N in {1, 2, 4}
   dividing P.
2. Time: Flux 2048 / 4096 px (24 heads x 128) and CogVideoX 768x1360 49 frames (48 x 64), the whole
   sequence (image + text tokens) sharded as xDiT's baseline does, bf16, batch 1: Ulysses-NCCL, USP-NCCL,
   Torus-NCCL, Torus-NVSHMEM on each shape; medians of CUDA-event times after warm-up, slowest rank; beside
   the no-communication bound (one rank's L/P queries against all L keys, the same SDPA kernel).
3. Capture one Torus-NVSHMEM layer in a CUDA graph, replay it, compare output and time.
Prints a short table (rank 0); writes every figure to OUT/layer_bench.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist

from streamfusion_diffusers import ParallelConfig, init_parallel, shutdown, sp_attention
from streamfusion_diffusers.core.config import METHODS
from streamfusion_diffusers.core.exactness import passes, reference_attention, relative_error
from streamfusion_diffusers.core.sequence import split_sizes
from streamfusion_diffusers.diffusers.graphs import capture
from streamfusion_diffusers.kernels.sdpa import attention_with_lse_sdpa

WORKLOADS = {  # name: (sequence tokens, heads, head dim)
    "flux-2048": (16384 + 512, 24, 128),
    "flux-4096": (65536 + 512, 24, 128),
    "cogvideox-49f": (53040 + 226, 48, 64),
}
TIMED = [("ulysses", "torch"), ("usp", "torch"), ("torus", "torch"), ("torus", "nvshmem")]


def log(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def shapes(world: int, wanted: list[int]) -> list[tuple[int, int]]:
    return [(n, world // n) for n in wanted if world % n == 0 and n <= world]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error over every rank's rows (collective)."""
    return relative_error(out, ref, distributed=True)


def slowest(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def time_ms(call: Callable[[], object], warmup: int, iters: int) -> float:
    """Median CUDA-event time of call() on this rank, ranks aligned by a barrier before each run."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def inputs(length: int, heads: int, dim: int, joint: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn((1, n, heads, dim), generator=g, device="cuda", dtype=torch.bfloat16)
                 for n in (length, length, length, joint, joint, joint))


def check(world: int, machine_counts: list[int]) -> list[dict]:
    """Every method x transport x shape against float32 attention, plus NVSHMEM against NCCL."""
    rank = dist.get_rank()
    length, heads, dim, joint = 64 * world * 8 + 3, 24, 128, 77  # uneven slices, joint rows uneven over R
    q, k, v, jq, jk, jv = inputs(length, heads, dim, joint, seed=int(time.time()) % 10_000 + 17)
    lens = split_sizes(length, world)
    rows = slice(sum(lens[:rank]), sum(lens[: rank + 1]))
    full_q, full_k, full_v = (torch.cat([a, b[:, rows] if a is jq else b], 1) for a, b in ((jq, q), (jk, k), (jv, v)))
    ref = reference_attention(full_q, full_k, full_v)
    results = []
    for n, m in shapes(world, machine_counts):
        for method in METHODS:
            outs = {}
            for backend in ("torch", "nvshmem"):
                ctx = init_parallel(ParallelConfig(machines=n, gpus_per_machine=m, method=method, backend=backend,
                                                   kernel="sdpa", strict=True))
                out, jout = sp_attention(q[:, rows], k[:, rows], v[:, rows], ctx, joint_q=jq, joint_k=jk,
                                         joint_v=jv, seq_lens=lens)
                outs[backend] = torch.cat([jout, out], 1)
                err = rel_err(outs[backend], ref)
                results.append(dict(shape=f"{n}x{m}", method=method, backend=backend, layout=str(ctx.layout(heads)),
                                    rel_err=err, ok=passes(err, torch.bfloat16)))
            diff = rel_err(outs["nvshmem"], outs["torch"])
            results.append(dict(shape=f"{n}x{m}", method=method, backend="nvshmem-vs-torch", rel_err=diff,
                                ok=passes(diff, torch.bfloat16)))
    return results


def no_comm_ms(length: int, heads: int, dim: int, warmup: int, iters: int) -> float:
    """One rank's share with no transfer: L/P queries against all L keys and values, all heads."""
    q, k, v, *_ = inputs(length, heads, dim, 0, seed=1)
    rows = q[:, : -(-length // dist.get_world_size())]
    return time_ms(lambda: attention_with_lse_sdpa(rows, k, v, dim ** -0.5), warmup, iters)


def bench(world: int, machine_counts: list[int], workloads: list[str], warmup: int, iters: int,
          kernel: str) -> list[dict]:
    rank = dist.get_rank()
    rows_out = []
    for name in workloads:
        length, heads, dim = WORKLOADS[name]
        bound = slowest(no_comm_ms(length, heads, dim, warmup, iters))
        q, k, v, *_ = inputs(length, heads, dim, 0, seed=2)
        lens = split_sizes(length, world)
        rows = slice(sum(lens[:rank]), sum(lens[: rank + 1]))
        ql, kl, vl = (x[:, rows].contiguous() for x in (q, k, v))
        del q, k, v
        for n, m in shapes(world, machine_counts):
            outs = {}
            for method, backend in TIMED:
                ctx = init_parallel(ParallelConfig(machines=n, gpus_per_machine=m, method=method, backend=backend,
                                                   kernel=kernel, strict=True))
                call = lambda: sp_attention(ql, kl, vl, ctx, seq_lens=lens)  # noqa: E731
                outs[(method, backend)] = call()
                ms = slowest(time_ms(call, warmup, iters))
                rows_out.append(dict(workload=name, shape=f"{n}x{m}", method=method, backend=backend,
                                     layout=str(ctx.layout(heads)), ms=ms, bound_ms=bound, ratio=ms / bound))
            diff = rel_err(outs[("torus", "nvshmem")], outs[("torus", "torch")])
            rows_out.append(dict(workload=name, shape=f"{n}x{m}", method="torus", backend="nvshmem-vs-torch",
                                 rel_err=diff, ok=passes(diff, torch.bfloat16)))
        torch.cuda.empty_cache()
    return rows_out


def graph_capture(world: int, workload: str, warmup: int, iters: int, kernel: str) -> dict:
    """Capture one Torus-NVSHMEM layer in a CUDA graph, replay it, and compare with eager calls."""
    rank = dist.get_rank()
    length, heads, dim = WORKLOADS[workload]
    q, k, v, *_ = inputs(length, heads, dim, 0, seed=3)
    lens = split_sizes(length, world)
    rows = slice(sum(lens[:rank]), sum(lens[: rank + 1]))
    ql, kl, vl = (x[:, rows].contiguous() for x in (q, k, v))
    ctx = init_parallel(ParallelConfig(machines=1, gpus_per_machine=world, method="torus", backend="nvshmem",
                                       kernel=kernel, strict=True))
    call = lambda: sp_attention(ql, kl, vl, ctx, seq_lens=lens)  # noqa: E731
    eager = call()
    eager_ms = slowest(time_ms(call, warmup, iters))
    try:
        dist.barrier()
        graph, static_out = capture(call, warmup=1)
        dist.barrier()
        graph.replay()
        torch.cuda.synchronize()
        diff = rel_err(static_out, eager)
        graph_ms = slowest(time_ms(graph.replay, warmup, iters))
        return dict(workload=workload, captured=True, rel_diff_vs_eager=diff, eager_ms=eager_ms, graph_ms=graph_ms,
                    saved_ms=eager_ms - graph_ms)
    except Exception as err:  # noqa: BLE001 - the report says what failed
        return dict(workload=workload, captured=False, error=f"{type(err).__name__}: {err}",
                    trace=traceback.format_exc()[-2000:], eager_ms=eager_ms)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for layer_bench.json")
    parser.add_argument("--machines", default="1,2,4", help="machine counts N to emulate placements for")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--kernel", default="auto", help="attention kernel of the timed runs (auto, sdpa, fused)")
    parser.add_argument("--skip-check", action="store_true")
    args = parser.parse_args()
    ctx = init_parallel(ParallelConfig(method="ring"))  # joins the launched job (NCCL, one GPU per process)
    world = ctx.world_size
    machine_counts = [int(x) for x in args.machines.split(",")]
    report: dict = dict(date=datetime.date.today().isoformat(), world=world, device=torch.cuda.get_device_name(),
                        torch=torch.__version__)
    failed = False
    if not args.skip_check:
        report["check"] = check(world, machine_counts)
        bad = [r for r in report["check"] if not r["ok"]]
        failed = bool(bad)
        log(f"check: {len(report['check']) - len(bad)}/{len(report['check'])} ok"
            + "".join(f"\n  MISMATCH {r}" for r in bad))
    report["bench"] = bench(world, machine_counts, args.workloads.split(","), args.warmup, args.iters,
                            args.kernel)
    report["graph"] = graph_capture(world, "flux-2048", args.warmup, args.iters, args.kernel)
    if dist.get_rank() == 0:
        with open(os.path.join(args.out, "layer_bench.json"), "w") as f:
            json.dump(report, f, indent=1)
        print(f"{'workload':<14} {'shape':<5} {'method':<8} {'backend':<17} {'layout':<24} {'ms':>8} {'bound':>7} "
              f"{'ratio':>6}")
        for r in report["bench"]:
            if "ms" in r:
                print(f"{r['workload']:<14} {r['shape']:<5} {r['method']:<8} {r['backend']:<17} {r['layout']:<24} "
                      f"{r['ms']:>8.3f} {r['bound_ms']:>7.3f} {r['ratio']:>6.3f}")
            else:
                print(f"{r['workload']:<14} {r['shape']:<5} torus    nvshmem-vs-torch  rel diff {r['rel_err']:.2e}")
        g = report["graph"]
        print("graph:", {k: v for k, v in g.items() if k != "trace"})
    shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
