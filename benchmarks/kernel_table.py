"""Issue 25, items 3-5: the attention kernels on one rank's share, on one GPU, bf16, B = 1.

A share is L/P query rows against all L keys (the work one rank does in one layer). Each column is captured
`--calls` times into one CUDA graph and the replays are timed with CUDA events (no Python between launches, so
shares of under 0.1 ms are measured without host overhead); min / median / max per call over `--reps` replays.
Columns: raw cuDNN, flash and efficient SDPA with and without the log-sum-exp (the no-LSE minimum is the bench's
no-communication bound), our sdpa path (`attention_with_lse(kernel="sdpa")`), our fused kernel as `kernel="fused"`
runs it on this GPU (kernels/fused.py: Gluon on Hopper), the Gluon and the portable Triton fused kernels by name,
and the Triton kernel with each tile config of the sweep (head dim 128).

    python benchmarks/kernel_table.py            # writes $OUT/kernel_table.json, prints a short table
    python benchmarks/kernel_table.py --set p1   # each model's attention at P = 1 (self and cross): the backend
                                                 # torch's default SDPA takes, beside ours without LSE
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from streamfusion_diffusers.kernels.attend import attention_with_lse
from streamfusion_diffusers.kernels import fused as fused_kernels
from streamfusion_diffusers.kernels.sdpa import BACKENDS, _call, attention_no_lse, attention_sdpa
from streamfusion_diffusers.kernels.triton_attention import DEFAULT_CONFIGS, TileConfig, multi_chunk_attention

# (name, query rows, key rows, heads, head dim): the table
SHARES = [("flux1024/P8", 576, 4608, 24, 128), ("flux2048/P2", 8448, 16896, 24, 128),
          ("flux4096/P2", 33024, 66048, 24, 128), ("cogvideox49-480x720/P2", 8888, 17776, 48, 64)]
# (name, query rows, key rows, heads, head dim): one GPU's whole attention in each model's step (P = 1)
P1 = [("wan2.2-ti2v-5b-720p121/self", 27280, 27280, 24, 128), ("wan2.2-ti2v-5b-720p121/cross", 27280, 512, 24, 128),
      ("flux2-dev-1024", 4608, 4608, 48, 128), ("qwen-image-1328", 7017, 7017, 24, 128),
      ("flux-dev-1024", 4608, 4608, 24, 128)]
SETS = {"shares": SHARES, "p1": P1}
SWEEP = [TileConfig(128, 64, 8, 3, True), TileConfig(128, 64, 4, 3, True), TileConfig(128, 128, 8, 2, True),
         TileConfig(64, 128, 4, 3, True), TileConfig(128, 64, 8, 4, False)]


def graph_ms(fn: Callable[[], object], calls: int, reps: int) -> list[float]:
    """Per-call milliseconds of `calls` launches of fn replayed from one CUDA graph, `reps` replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    out = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / calls)
    return out


def fused(q, k, v, scale: float, cfg: TileConfig | None = None, gluon: bool = False) -> Callable[[], object]:
    """One fused launch over all keys: the Gluon kernel, or the Triton kernel with tile config cfg."""
    b, length, h, d = q.shape
    out = torch.empty_like(q)
    lse = torch.empty((b, h, length), device=q.device, dtype=torch.float32)
    if gluon:
        from streamfusion_diffusers.kernels.gluon_attention import multi_chunk_attention as gluon_kernel

        return lambda: gluon_kernel([q], [(k, v)], [(None, lse)], [out], scale, True)
    return lambda: multi_chunk_attention([q], [(k, v)], [(None, lse)], [out], scale, True, cfg)


def columns(q, k, v, scale: float, sweep: bool) -> dict[str, Callable[[], object]]:
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    cols: dict[str, Callable[[], object]] = {}
    for backend in BACKENDS:
        cols[f"{backend}+lse"] = lambda backend=backend: _call(backend, qt, kt, vt, scale)[0].transpose(1, 2)
        cols[f"{backend}"] = lambda backend=backend: attention_no_lse(backend, q, k, v, scale)
    cols["torch default"] = lambda: F.scaled_dot_product_attention(qt, kt, vt, scale=scale).transpose(1, 2)
    cols["ours no-lse"] = lambda: attention_sdpa(q, k, v, scale)
    cols["ours sdpa"] = lambda: attention_with_lse(q, k, v, scale, "sdpa")
    cols["ours fused"] = lambda: attention_with_lse(q, k, v, scale, "fused")
    if torch.cuda.get_device_capability() == (9, 0):
        cols["fused gluon"] = fused(q, k, v, scale, gluon=True)
    cols["fused triton"] = fused(q, k, v, scale)
    if q.shape[-1] == 128 and sweep:
        for cfg in SWEEP:
            cols[f"fused {cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"
                 f"{' tma' if cfg.use_tma else ''}"] = fused(q, k, v, scale, cfg)
    return cols


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--set", choices=sorted(SETS), default="shares", help="which shapes (see above)")
    parser.add_argument("--budget-ms", type=float, default=200.0, help="graph length: about this much work")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for name, lq, lk, heads, dim in SETS[args.set]:
        q = torch.randn(1, lq, heads, dim, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, lk, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        scale = dim ** -0.5
        ref = attention_with_lse(q, k, v, scale, "sdpa")[0].float()
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        default = torch.nn.attention.SDPBackend(torch._fused_sdp_choice(qt, kt, vt, scale=scale)).name
        row = {"share": name, "q": lq, "k": lk, "heads": heads, "dim": dim, "torch_default": default, "ms": {},
               "error": {}}
        for col, fn in columns(q, k, v, scale, args.set == "shares").items():
            try:
                once = graph_ms(fn, 1, 3)
                times = graph_ms(fn, max(1, min(200, int(args.budget_ms / max(once) + 1))), args.reps)
            except Exception as err:  # noqa: BLE001  a config the chip cannot run (shared memory) is reported
                row["ms"][col] = {"error": str(err)[:200]}
                continue
            row["ms"][col] = {"min": min(times), "median": statistics.median(times), "max": max(times)}
            res = fn()
            if col.startswith("fused "):
                continue  # launches into a buffer of their own: "ours fused" checks the kernel's output
            out = res[0] if isinstance(res, tuple) else res
            row["error"][col] = ((out.float() - ref).norm() / ref.norm()).item()
        rows.append(row)
        med = {c: t["median"] for c, t in row["ms"].items() if "median" in t}
        best_fused = min((t, c) for c, t in med.items() if c.startswith("fused "))
        print(f"{name}: cudnn {med['cudnn']:.4f} cudnn+lse {med['cudnn+lse']:.4f} flash+lse "
              f"{med.get('flash+lse', float('nan')):.4f} ours-sdpa {med['ours sdpa']:.4f} "
              f"({med['ours sdpa'] / med['cudnn+lse']:.3f}x) ours-fused {med['ours fused']:.4f} "
              f"(cudnn+lse/fused {med['cudnn+lse'] / med['ours fused']:.3f}, triton "
              f"{med['cudnn+lse'] / med['fused triton']:.3f}) fastest fused {best_fused[1]} "
              f"{best_fused[0]:.4f} no-LSE min {min(med[b] for b in BACKENDS if b in med):.4f} torch default "
              f"({default}) {med['torch default']:.4f} ours no-lse {med['ours no-lse']:.4f}", flush=True)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "fused_kernel":
           fused_kernels.kernel_for(torch.device("cuda", torch.cuda.current_device())).__module__,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "default_configs":
           {d: vars(c) for d, c in DEFAULT_CONFIGS.items()}, "rows": rows}
    name = "kernel_table.json" if args.set == "shares" else f"kernel_table_{args.set}.json"
    with open(os.path.join(os.environ.get("OUT", "."), name), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
