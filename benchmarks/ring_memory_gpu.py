"""GPU memory of one Ring / Torus attention layer against the size of one K/V block (issue 22).

    streamfusion launch --nproc-per-node 8 benchmarks/ring_memory_gpu.py --out "$OUT"    # 2+ GPUs, < 1 minute

Flux 4096 px (65,536 image + 512 text tokens, 24 heads x 128, bfloat16). For ring (R = P) and torus on this host,
the peak memory one layer allocates beyond its inputs and output, in units of one peer K/V block (K and V of
one rank's slice, after the Ulysses all-to-all): a ring pass that keeps every block needs about R - 1 of them,
one that lets each go needs about 2 (the one in use and the one arriving) plus the kernel's workspace.
Prints one line per method (rank 0); writes ring_memory_gpu.json to --out.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from streamfusion_diffusers import ParallelConfig, init_parallel, shutdown, sp_attention

TOKENS, TEXT, HEADS, DIM = 65536, 512, 24, 128


def peak_blocks(config: ParallelConfig) -> dict:
    ctx = init_parallel(config)
    world, layout = ctx.world_size, ctx.layout(HEADS)
    local = TOKENS // world
    q, k, v = (torch.randn(1, local, HEADS, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    jq, jk, jv = (torch.randn(1, TEXT, HEADS, DIM, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    call = lambda: sp_attention(q, k, v, ctx, joint_q=jq, joint_k=jk, joint_v=jv)  # noqa: E731
    call()  # warm-up: kernels chosen, buffers made
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = call()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base - sum(o.numel() * o.element_size() for o in out)
    block = 2 * local * (HEADS // layout.ulysses) * DIM * 2  # K and V of one peer's slice, its heads, bf16
    worst = torch.tensor([extra], dtype=torch.float64, device="cuda")
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return dict(method=config.method, layout=str(layout), ring=layout.ring, peak_extra_mib=worst.item() / 2**20,
                block_mib=block / 2**20, in_blocks=worst.item() / block)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    ctx = init_parallel(ParallelConfig(method="ring"))  # joins the launched job
    world = ctx.world_size
    configs = [ParallelConfig(machines=1, gpus_per_machine=world, method="ring", kernel="sdpa"),
               ParallelConfig(machines=2 if world % 2 == 0 else 1, gpus_per_machine=world // (2 if world % 2 == 0
                              else 1), method="torus", kernel="sdpa")]
    rows = [peak_blocks(c) for c in configs]
    if dist.get_rank() == 0:
        for r in rows:
            print(f"{r['method']:<6} {r['layout']:<20} R={r['ring']}: peak {r['peak_extra_mib']:.0f} MiB beyond "
                  f"inputs and output = {r['in_blocks']:.1f} peer K/V blocks of {r['block_mib']:.0f} MiB")
        with open(os.path.join(args.out, "ring_memory_gpu.json"), "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), world=world, rows=rows), f, indent=1)
    shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
