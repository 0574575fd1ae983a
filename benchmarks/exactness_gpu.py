"""Honest bfloat16 relative errors of the attention kernels on one GPU, at real sizes (issue 22).

    python benchmarks/exactness_gpu.py --out "$OUT"          # one GPU, about 2 minutes

One rank's share of a layer at P = 8 (its L/8 query rows over every key), Flux 4096 px (65,536 image + 512 text
tokens, 24 heads x 128) and CogVideoX 768 x 1360, 49 frames (53,040 + 226 tokens, 48 heads x 64), against softmax
attention written out in torch in float32 (exactness.reference_attention):
- sdpa / fused: one call over every key (Ulysses' and USP's last step);
- sdpa-merged / fused-merged: the keys in 8 blocks, each merged by log-sum-exp into the running state (the
  single-process schedule of a ring pass: what Ring, USP, TAS and Torus compute on every rank).
Prints one line per case and the threshold; writes exactness_gpu.json to --out.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from streamfusion_diffusers.core.exactness import reference_attention, relative_error, threshold
from streamfusion_diffusers.kernels.attend import attend_chunks
from streamfusion_diffusers.kernels.partial import Partial

SIZES = {"flux-4096": (65536 + 512, 24, 128), "cogvideox-49f": (53040 + 226, 48, 64)}
SHARE, BLOCKS = 8, 8


def schedule(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: int) -> torch.Tensor:
    """q attends to k, v in `blocks` key blocks, one call each, merged into one running state."""
    partial = Partial()
    ks, vs = k.chunk(blocks, dim=1), v.chunk(blocks, dim=1)
    for i, kv in enumerate(zip(ks, vs)):
        attend_chunks([partial], [q], [kv], kernel=kernel, finalize=i == blocks - 1)
    return partial.result(q.dtype)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(args.seed)
    dtype, rows = torch.bfloat16, []
    for name, (length, heads, dim) in SIZES.items():
        k, v = (torch.randn(1, length, heads, dim, generator=g, device="cuda", dtype=dtype) for _ in range(2))
        q = torch.randn(1, length // SHARE, heads, dim, generator=g, device="cuda", dtype=dtype)
        ref = reference_attention(q, k, v)
        for kernel in ("sdpa", "fused"):
            for blocks in (1, BLOCKS):
                case = kernel if blocks == 1 else f"{kernel}-merged"
                try:
                    err = relative_error(schedule(kernel, q, k, v, blocks), ref)
                except (ValueError, RuntimeError) as exc:  # e.g. no triton: say so, go on
                    rows.append(dict(workload=name, case=case, error=f"{type(exc).__name__}: {exc}"[:200]))
                    continue
                rows.append(dict(workload=name, case=case, queries=q.shape[1], keys=length, rel_err=err))
        del q, k, v, ref
        torch.cuda.empty_cache()
    limit = threshold(dtype)
    for r in rows:
        print(f"{r['workload']:<14} {r['case']:<13} " + (f"rel err {r['rel_err']:.2e} ({limit / r['rel_err']:.1f}x "
              f"under the threshold {limit:.1e})" if "rel_err" in r else r["error"]))
    report = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, dtype="bfloat16", threshold=limit,
                  rows=rows)
    with open(os.path.join(args.out, "exactness_gpu.json"), "w") as f:
        json.dump(report, f, indent=1)
    return 0 if all(r.get("rel_err", 0.0) <= limit for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
