"""Honest relative errors of every method on the CPU, per input dtype: the table behind exactness.THRESHOLD.

    PYTHONPATH=$PWD python benchmarks/exactness_cpu.py [--sizes 61:5:4:16,1024:64:24:128,16384:64:4:64] [--seeds 3]

For every size TOKENS:TEXT:HEADS:HEAD_DIM, dtype and seed, `streamfusion verify`'s check (2 x 2 gloo processes,
every method, U = default and U = 2) against softmax attention in float64; prints a markdown table of the
largest relative error per dtype and method, the threshold and its margin over the largest.
"""
from __future__ import annotations

import argparse
from collections import defaultdict

from streamfusion_diffusers import ParallelConfig
from streamfusion_diffusers.runtime.run import run_local
from streamfusion_diffusers.commands.verify import DTYPES, Workload, _verify_rank
from streamfusion_diffusers.core.config import METHODS
from streamfusion_diffusers.core.exactness import threshold


def configs(ulysses: int | None) -> list[ParallelConfig]:
    return [ParallelConfig(machines=2, gpus_per_machine=2, method=m,
                           ulysses=ulysses if m not in ("ulysses", "ring") else None) for m in METHODS]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="61:5:4:16,1024:64:24:128,16384:64:4:64")
    parser.add_argument("--dtypes", default="float32,float16,bfloat16")
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    worst: dict[tuple[str, str], float] = defaultdict(float)
    for size in args.sizes.split(","):
        tokens, text, heads, dim = map(int, size.split(":"))
        for name in args.dtypes.split(","):
            for seed in range(args.seeds if tokens < 4096 else 1):
                w = Workload(1, tokens, text, heads, dim, DTYPES[name], seed, 0)
                for ulysses in (None, 2):
                    table = run_local(_verify_rank, 4, configs(ulysses), w, (), timeout_s=3600)[0]
                    for row in table:
                        key = (name, row["method"])
                        worst[key] = max(worst[key], row["rel_err"])
                        print(f"{size} {name} seed {seed} {row['layout']}: {row['rel_err']:.2e}", flush=True)
    print(f"\n| dtype | {' | '.join(METHODS)} | largest | threshold | margin |")
    print("|---|" + "---:|" * (len(METHODS) + 3))
    for name in args.dtypes.split(","):
        errs = [worst[(name, m)] for m in METHODS]
        limit = threshold(DTYPES[name])
        print(f"| {name} | {' | '.join(f'{e:.2e}' for e in errs)} | {max(errs):.2e} | {limit:.1e} | "
              f"{limit / max(errs):.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
