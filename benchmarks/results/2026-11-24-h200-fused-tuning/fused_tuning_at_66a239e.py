"""Issue 25 item 3: the fused Triton kernel's candidates against cuDNN SDPA with LSE, on one GPU, bf16, B = 1.

At the shares where the fused kernel must reach 0.95x of cuDNN + LSE (Flux 2048 and 4096, P = 2, head dim 128)
and at the CogVideoX head-dim-64 share where it leads. Each candidate is timed as in kernel_table.py (calls
captured into one CUDA graph, replays timed with CUDA events, min / median / max per call), cuDNN before and
after the candidates (drift shows as their difference), and checked against float32 attention on the share's
first 1,024 query rows (core/exactness.py's threshold).

    python benchmarks/fused_tuning.py            # writes $OUT/fused_tuning.json, prints one line per candidate
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, replace

import torch

from kernel_table import SHARES, graph_ms
from streamfusion_diffusers.core.exactness import reference_attention, relative_error, threshold
from streamfusion_diffusers.kernels.sdpa import _call
from streamfusion_diffusers.kernels.triton_attention import DEFAULT_CONFIGS, TileConfig, multi_chunk_attention

BASE = DEFAULT_CONFIGS
CANDIDATES: dict[int, dict[str, TileConfig]] = {
    128: {
        "default": BASE[128],
        "v loaded after softmax": replace(BASE[128], v_late=True),
        "no acc multi-buffer": replace(BASE[128], no_acc_mb=True),
        "v late, no acc multi-buffer": replace(BASE[128], v_late=True, no_acc_mb=True),
        "default again": BASE[128],
    },
    64: {"default": BASE[64]},
}
CHECK_ROWS = 1024


def timed(fn, budget_ms: float, reps: int) -> dict[str, float]:
    once = graph_ms(fn, 1, 3)
    times = graph_ms(fn, max(1, min(200, int(budget_ms / max(once) + 1))), reps)
    return {"min": min(times), "median": statistics.median(times), "max": max(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--budget-ms", type=float, default=200.0, help="graph length: about this much work")
    parser.add_argument("--shares", default="flux2048/P2,flux4096/P2,cogvideox49-480x720/P2")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for name, lq, lk, heads, dim in SHARES:
        if name not in args.shares.split(","):
            continue
        q = torch.randn(1, lq, heads, dim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, lk, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        scale = dim ** -0.5
        ref = reference_attention(q[:, :CHECK_ROWS], k, v, scale)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        cudnn = lambda: _call("cudnn", qt, kt, vt, scale)  # noqa: E731
        row = {"share": name, "q": lq, "k": lk, "heads": heads, "dim": dim, "cudnn+lse": [timed(cudnn, args.budget_ms,
                                                                                              args.reps)]}
        for label, cfg in CANDIDATES[dim].items():
            out = torch.empty_like(q)
            lse = torch.empty((1, heads, lq), device=q.device, dtype=torch.float32)
            fn = lambda cfg=cfg, out=out, lse=lse: multi_chunk_attention(  # noqa: E731
                [q], [(k, v)], [(None, lse)], [out], scale, True, cfg)
            try:
                t = timed(fn, args.budget_ms, args.reps)
            except Exception as err:  # noqa: BLE001  a candidate the compiler or the chip rejects is reported
                row[label] = {"config": asdict(cfg), "error": f"{type(err).__name__}: {str(err)[:300]}"}
                print(f"{name} {label}: {row[label]['error']}", flush=True)
                continue
            out.fill_(float("nan"))  # every element must be written again
            fn()
            row[label] = {"config": asdict(cfg), "ms": t, "rel_err": relative_error(out[:, :CHECK_ROWS].float(), ref)}
        row["cudnn+lse"].append(timed(cudnn, args.budget_ms, args.reps))
        base = statistics.mean(t["median"] for t in row["cudnn+lse"])
        for label in CANDIDATES[dim]:
            if "ms" in row[label]:
                row[label]["cudnn_over_fused"] = base / row[label]["ms"]["median"]
                print(f"{name} {label}: {row[label]['ms']['median']:.4f} ms ({row[label]['ms']['min']:.4f}-"
                      f"{row[label]['ms']['max']:.4f}) cudnn+lse/fused {row[label]['cudnn_over_fused']:.3f} "
                      f"err {row[label]['rel_err']:.2e} (<= {threshold(torch.bfloat16):.1e})", flush=True)
        print(f"{name} cudnn+lse before/after: " + " / ".join(f"{t['median']:.4f}" for t in row["cudnn+lse"]),
              flush=True)
        rows.append(row)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": rows}
    with open(os.path.join(os.environ.get("OUT", "."), "fused_tuning.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
