"""Python calls and host microseconds per attention call, per transformer block and per forward, for each layout.

On the CPU (gloo ranks spawned here; the counts are what matters, the microseconds include tiny CPU kernels):

    python benchmarks/host_path.py --world 2 --layouts ulysses,usp:U2R1,tas:U2R1,ring

On GPUs (NCCL, bf16, Flux-dev's heads; the microseconds are the host's time to issue one call):

    torchrun --nproc-per-node 2 benchmarks/host_path.py --layouts ulysses,usp:U2R1,tas:U2R1 \
        --heads 24 --head-dim 128 --grid 64x64 --text 512

Rank 0 prints one row per layout and what (plain diffusers first: the whole sequence on one process, SDPA), and
writes every figure to $OUT/host_path_<label>.json (default outputs/), with the Python functions one attention
call runs, in order; --label names the code that ran.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch
import torch.distributed as dist

from streamfusion_diffusers.bench.host_path import Shape, run_rank
from streamfusion_diffusers.runtime.pool import ProcessPool


def table(results: list) -> str:
    lines = [f"{'layout':<48} {'what':<14} {'py calls':>9} {'C calls':>8} {'host us':>9}"]
    for m in results:
        for what in ("attention", "joint_block", "single_block", "forward"):
            c = getattr(m, what)
            lines.append(f"{m.label:<48} {what:<14} {c.python:>9.0f} {c.c:>8.0f} {c.host_us:>9.0f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", default="ulysses,usp:U2R1,tas:U2R1")
    parser.add_argument("--world", type=int, default=2, help="gloo ranks to spawn (without torchrun)")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--grid", default="16x16", help="latent tokens, rows x cols")
    parser.add_argument("--text", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--label", default="run")
    args = parser.parse_args()
    rows, cols = (int(x) for x in args.grid.split("x"))
    shape = Shape(args.heads, args.head_dim, (rows, cols), args.text)
    layouts = args.layouts.split(",")
    if "RANK" in os.environ:  # under torchrun: GPUs, NCCL, bf16
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        results = run_rank(layouts, shape, args.reps, torch.bfloat16)
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank:
            return
    else:
        with ProcessPool(args.world) as pool:
            results = pool.run(run_rank, layouts, shape, args.reps)[0]
    print(table(results))
    folder = os.environ.get("OUT", "outputs")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"host_path_{args.label}.json")
    with open(path, "w") as f:
        json.dump({"shape": dataclasses.asdict(shape), "layouts": layouts,
                   "results": [{"label": m.label, **{w: {k: v for k, v in dataclasses.asdict(getattr(m, w)).items()
                                                          if k != "functions"}
                                                      for w in ("attention", "joint_block", "single_block", "forward")},
                                "attention_functions": m.attention.functions}
                               for m in results]}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
