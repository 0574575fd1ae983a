"""Soak (issue 13): many consecutive attention layers and whole Flux.1-dev steps on fixed inputs, per transport.

Memory must stay flat after warm-up and every repetition must give the same bits. For each transport (NCCL,
then NVSHMEM) it runs --layers Flux attention layers (16,384 + 512 tokens, 24 heads of 128, bf16) and then
--steps whole Flux.1-dev transformer calls (its real diffusers config, random weights, parallelized with
`parallelize`), every one on the same inputs. Every output is compared with the first on the GPU (no host
sync per repetition); torch.cuda memory (allocated now, and peak since warm-up) and the host's resident
memory are sampled after warm-up, half-way and at the end, the largest rank's. The NVSHMEM mailbox lives
outside torch's allocator: its size is reported too. Rank 0 prints a table and writes soak.json under --out.

    python3 -m streamfusion_diffusers launch --nproc-per-node 2 --model flux-dev --resolution 2048 \\
        benchmarks/soak.py --layers 1000 --steps 200 --out $OUT/soak
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from streamfusion_diffusers import ParallelConfig, init_parallel, shutdown, sp_attention
from streamfusion_diffusers.backends.nvshmem_runtime import NvshmemUnavailable
from streamfusion_diffusers.bench.model import model_inputs
from streamfusion_diffusers.choice.workloads import flux
from streamfusion_diffusers.models import MODELS
from streamfusion_diffusers.models.build import build_transformer
from streamfusion_diffusers import parallelize, unparallelize

WARMUP = {"layer": 20, "step": 3}
# Allocated bytes must not move at all. The peak may move by one block of the caching allocator (2 MiB: a
# different free order splits a segment differently at the transient maximum); a leak shows in allocated bytes.
PEAK_SLACK = 2 << 20


def memory(device: torch.device) -> tuple[int, int, int]:
    """(GPU bytes allocated now, GPU peak since the last reset, host resident bytes), the largest rank's."""
    gpu = device.type == "cuda"
    if gpu:
        torch.cuda.synchronize(device)
    resident = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    got = torch.tensor([torch.cuda.memory_allocated(device) if gpu else 0,
                        torch.cuda.max_memory_allocated(device) if gpu else 0, resident], device=device)
    dist.all_reduce(got, op=dist.ReduceOp.MAX)
    return int(got[0]), int(got[1]), int(got[2])


def soak(run, count: int, level: str, device: torch.device) -> dict:
    """Call `run()` WARMUP + count times; every output against the first, memory at warm-up, half and end."""
    first = run().clone()
    for _ in range(WARMUP[level] - 1):
        run()
    differ = torch.zeros((), dtype=torch.int64, device=device)  # before the first sample: it holds 512 bytes
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    warm = memory(device)
    start, half = time.perf_counter(), None
    for i in range(count):
        differ += (run() != first).any()
        if i == count // 2:
            half = memory(device)
    end = memory(device)
    seconds = time.perf_counter() - start
    dist.all_reduce(differ, op=dist.ReduceOp.MAX)
    return {"count": count, "ms_each": 1e3 * seconds / count, "differing": int(differ),
            "allocated": [warm[0], half[0], end[0]], "peak": [warm[1], half[1], end[1]],
            "host_resident": [warm[2], half[2], end[2]],
            "flat": warm[0] == end[0] and end[1] - half[1] <= PEAK_SLACK}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=1000, help="attention layers per transport (default 1000)")
    parser.add_argument("--steps", type=int, default=200, help="whole transformer steps per transport (default 200)")
    parser.add_argument("--resolution", type=int, default=2048, help="Flux image side in pixels (default 2048)")
    parser.add_argument("--method", default="torus", help="the SP method (default torus: every stage, most state)")
    parser.add_argument("--backends", nargs="+", default=["torch", "nvshmem"], help="torch (NCCL) and/or nvshmem")
    parser.add_argument("--model", default="flux-dev", help="flux-dev, or tiny-flux for a CPU check")
    parser.add_argument("--out", default=os.environ.get("OUT", "outputs") + "/soak")
    args = parser.parse_args()

    gpu = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if gpu else torch.device("cpu")
    dtype = torch.bfloat16 if gpu else torch.float32
    if gpu:
        torch.cuda.set_device(device)
    w = flux(args.resolution)
    contexts, rows = {}, []
    for backend in args.backends:
        try:
            contexts[backend] = init_parallel(ParallelConfig(machines=1, method=args.method, backend=backend,
                                                             strict=True))
        except NvshmemUnavailable as err:
            rows.append({"level": "-", "backend": backend, "unavailable": str(err)})
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(dist.get_rank())
    q, k, v = (torch.randn(1, w.tokens // world, w.heads, w.head_dim, generator=g).to(device, dtype)
               for _ in range(3))
    jq, jk, jv = (torch.randn(1, w.text_tokens, w.heads, w.head_dim, generator=torch.Generator().manual_seed(0))
                  .to(device, dtype) for _ in range(3))
    with torch.no_grad():
        for backend, ctx in contexts.items():
            rows.append({"level": "layer", "backend": backend, **soak(
                lambda: sp_attention(q, k, v, ctx, joint_q=jq, joint_k=jk, joint_v=jv)[0], args.layers, "layer",
                device)})
            mailbox = getattr(ctx.transport, "mailbox", None)
            rows[-1]["mailbox_bytes"] = None if mailbox is None else mailbox.capacity
        if args.steps:
            config = MODELS[args.model].transformer
            model = build_transformer(config, seed=0, dtype=dtype, device=device)
            inputs = model_inputs(w, config, 1, dtype, device)
            for backend, ctx in contexts.items():
                parallelize(model, ctx)
                rows.append({"level": "step", "backend": backend,
                             **soak(lambda: model(**inputs)[0], args.steps, "step", device)})
                unparallelize(model)
    if dist.get_rank() == 0:
        report(rows, args, w, world)
    shutdown()


def report(rows: list[dict], args: argparse.Namespace, w, world: int) -> None:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "soak.json").write_text(json.dumps(rows, indent=1))
    gib = 2**30
    print(f"soak: {world} ranks, {args.method}, {args.model} at {args.resolution} px ({w.tokens} + {w.text_tokens} "
          f"tokens); memory: the largest rank's, after warm-up / half-way / end")
    print(f"{'level':<6} {'transport':<9} {'count':>6} {'ms each':>8} {'identical':>9}  {'allocated GiB':<20} "
          f"{'peak GiB':<20} {'flat':<4}  host MiB")
    for r in rows:
        name = "nccl" if r["backend"] == "torch" else r["backend"]
        if "unavailable" in r:
            print(f"{'-':<6} {name:<9} unavailable: {r['unavailable']}")
            continue
        alloc = " / ".join(f"{x / gib:.2f}" for x in r["allocated"])
        peak = " / ".join(f"{x / gib:.2f}" for x in r["peak"])
        same = "yes" if r["differing"] == 0 else "NO"
        host = " / ".join(f"{x / 2**20:.0f}" for x in r["host_resident"])
        print(f"{r['level']:<6} {name:<9} {r['count']:>6} {r['ms_each']:>8.2f} {same:>9}  {alloc:<20} {peak:<20} "
              f"{'yes' if r['flat'] else 'NO':<4}  {host}")
    for r in rows:
        if r.get("mailbox_bytes"):
            print(f"NVSHMEM mailbox after the layers: {r['mailbox_bytes'] / 2**20:.0f} MiB per peer (outside torch)")
    ok = all("unavailable" in r or (r["differing"] == 0 and r["flat"]) for r in rows)
    print(f"soak {'PASS' if ok else 'FAIL'}: outputs identical and memory flat after warm-up; wrote "
          f"{Path(args.out, 'soak.json')}")


if __name__ == "__main__":
    main()
