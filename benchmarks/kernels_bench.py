"""Issue 6 kernel benchmark on one GPU: single-chunk throughput against cuDNN SDPA (with a sweep of the portable
Triton fused kernel's tile configs), the Ring and Torus chunk patterns of a Flux 4096x4096 and a CogVideoX
160-frame layer on 8 GPUs (the device's fused kernel, kernels/fused.py, vs launch-and-merge), and the one-pass
merge against torch's. bf16, B=1, fresh random
inputs, medians of triton.testing.do_bench (which flushes L2 between runs). Prints a short table; writes
every figure to $OUT/kernels_bench.json (or ./kernels_bench.json).

    python benchmarks/kernels_bench.py [--quick]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict

import torch
import triton
from triton.testing import do_bench

from streamfusion_diffusers.kernels import dispatch, triton_attention
from streamfusion_diffusers.kernels.attend import attend_chunks
from streamfusion_diffusers.kernels.merge import merge_into, merge_into_reference
from streamfusion_diffusers.kernels.partial import Partial
from streamfusion_diffusers.kernels.sdpa import BACKENDS, _call, attention_with_lse_sdpa
from streamfusion_diffusers.kernels.state import current
from streamfusion_diffusers.kernels.triton_attention import TileConfig, multi_chunk_attention

DTYPE = torch.bfloat16
RANKS = 8
# (name, tokens, heads, head dim): FACTS.md's workloads, tokens = image/video + text.
LAYERS = [("flux4096", 66_048, 24, 128), ("cogvideox160", 167_506, 48, 64)]
# Tile configs tried per head dim (block_m, block_n, warps, stages, TMA); the first run's sweep (BENCHMARKS.md)
# dropped the losers.
SWEEP = {
    128: [TileConfig(128, 128, 8, 3, True), TileConfig(128, 128, 8, 2, True), TileConfig(128, 64, 8, 4, True),
          TileConfig(128, 64, 8, 5, True), TileConfig(64, 128, 4, 3, True), TileConfig(128, 128, 8, 3)],
    64: [TileConfig(128, 64, 4, 3, True), TileConfig(128, 64, 4, 4, True), TileConfig(128, 64, 8, 4, True),
         TileConfig(128, 128, 8, 3, True), TileConfig(128, 64, 8, 3)],
}


def split(n: int, parts: int) -> list[int]:
    base, extra = divmod(n, parts)
    return [base + (i < extra) for i in range(parts)]


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=DTYPE)


def bench_ms(fn: Callable[[], object], rep: int) -> float:
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def sdpa_lse_shapes() -> dict[str, object]:
    """Raw LSE shape of each aten op at an Lq that is not a multiple of 32, and its error against float32."""
    from streamfusion_diffusers.kernels.reference import attention_with_lse_reference

    q, k, v = rand(1, 1000, 4, 128), rand(1, 1500, 4, 128), rand(1, 1500, 4, 128)
    _, ref_lse = attention_with_lse_reference(q, k, v, 0.1)
    found = {}
    for backend in BACKENDS:
        try:
            _, raw = _call(backend, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.1)
            _, lse = attention_with_lse_sdpa(q, k, v, 0.1, backends=[backend])
            found[backend] = {"raw_lse_shape": list(raw.shape), "raw_dtype": str(raw.dtype),
                              "max_abs_err_vs_fp32_natural_log": (lse - ref_lse).abs().max().item()}
        except RuntimeError as err:
            found[backend] = {"error": str(err)[:300]}
    return found


def single_chunk(rep: int) -> tuple[list[dict], dict[int, TileConfig]]:
    """cuDNN and flash SDPA with LSE against every fused config, one chunk of L x L; the best config per D."""
    rows, best = [], {}
    for dim, heads, length in [(128, 24, 16_384), (64, 24, 32_768)]:
        q, k, v = rand(1, length, heads, dim), rand(1, length, heads, dim), rand(1, length, heads, dim)
        flops = 4 * heads * length * length * dim
        scale = dim ** -0.5
        times = {f"sdpa-{b}": bench_ms(lambda b=b: attention_with_lse_sdpa(q, k, v, scale, backends=[b]), rep)
                 for b in ("cudnn", "flash")}
        out, lse = torch.empty_like(q), torch.empty(1, heads, length, device="cuda")
        configs = {}
        for cfg in SWEEP[dim]:
            name = f"fused-{cfg.block_m}x{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}{'-tma' if cfg.use_tma else ''}"
            configs[name] = cfg
            try:
                times[name] = bench_ms(lambda cfg=cfg: multi_chunk_attention(
                    [q], [(k, v)], [(None, lse)], [out], scale, True, cfg), rep)
            except Exception as err:  # a config the compiler rejects (shared memory, registers) is skipped
                logging.warning("%s failed: %s", name, str(err)[:200])
        fused = {n: t for n, t in times.items() if n.startswith("fused")}
        best[dim] = configs[min(fused, key=fused.get)]
        for name, ms in times.items():
            rows.append({"head_dim": dim, "heads": heads, "L": length, "kernel": name, "ms": ms,
                         "tflops": flops / ms / 1e9, "vs_cudnn": times["sdpa-cudnn"] / ms})
    return rows, best


def patterns(rep: int) -> list[dict]:
    """Ring (U1R8) and Torus (U8R1, T=8) chunk patterns of one rank of an 8-GPU layer."""
    rows = []
    for layer, length, heads, dim in LAYERS:
        lens = split(length, RANKS)
        for method in ("ring", "torus"):
            if method == "ring":  # local queries, all heads; one peer's K/V block per step
                q_chunks = [rand(1, lens[0], heads, dim)]
                kv_steps = [[(rand(1, n, heads, dim), rand(1, n, heads, dim))] for n in lens]
                work_heads, q_rows = heads, lens[0]
            else:  # one head group; every peer's query rows (head-sliced views), one peer's K/V per stage
                h = heads // RANKS
                q_full, k_full, v_full = (rand(1, length, heads, dim) for _ in range(3))
                q_chunks = list(q_full[:, :, :h].split(lens, dim=1))
                kv_steps = [[kv] for kv in zip(k_full[:, :, :h].split(lens, 1), v_full[:, :, :h].split(lens, 1))]
                work_heads, q_rows = h, length
            stage_flops = 4 * work_heads * q_rows * lens[1] * dim
            layer_flops = 4 * work_heads * q_rows * length * dim
            results = {}
            for kernel in ("sdpa", "fused"):
                def run_layer(kernel: str = kernel) -> list[Partial]:
                    partials = [Partial() for _ in q_chunks]
                    for i, kv in enumerate(kv_steps):
                        attend_chunks(partials, q_chunks, kv, kernel=kernel, finalize=i == len(kv_steps) - 1)
                    return partials

                mid = [Partial() for _ in q_chunks]
                attend_chunks(mid, q_chunks, kv_steps[0], kernel=kernel)
                results[kernel] = {
                    "stage_ms": bench_ms(lambda: attend_chunks(mid, q_chunks, kv_steps[1], kernel=kernel), rep),
                    "layer_ms": bench_ms(run_layer, rep),
                    "out": torch.cat([p.result(DTYPE) for p in run_layer()], dim=1),
                }
            dispatch.clear()
            attend_chunks(mid, q_chunks, kv_steps[1], kernel="auto")
            auto = next(iter(current().local.values()))  # the standalone call's pick
            fused_out, sdpa_out = results["fused"]["out"].float(), results["sdpa"]["out"].float()
            diff = (fused_out - sdpa_out).norm() / sdpa_out.norm()
            for kernel, r in results.items():
                rows.append({"layer": layer, "method": method, "kernel": kernel, "q_chunks": len(q_chunks),
                             "q_rows": q_rows, "heads": work_heads, "kv_lens": lens,
                             "stage_ms": r["stage_ms"], "stage_tflops": stage_flops / r["stage_ms"] / 1e9,
                             "layer_ms": r["layer_ms"], "layer_tflops": layer_flops / r["layer_ms"] / 1e9,
                             "rel_diff_fused_vs_sdpa": diff.item(), "auto_picks_for_stage": auto})
            del q_chunks, kv_steps, mid, results
            torch.cuda.empty_cache()
    return rows


def merges(rep: int) -> list[dict]:
    """One merge of a Flux Ring step's partial (8256 x 24 x 128) into the float32 state: torch vs Triton."""
    b, lq, h, d = 1, 8256, 24, 128
    out, lse = torch.randn(b, lq, h, d, device="cuda"), torch.randn(b, h, lq, device="cuda")
    new_out, new_lse = rand(b, h, lq, d).transpose(1, 2), torch.randn(b, h, lq, device="cuda")
    moved = 2 * out.numel() * 4 + new_out.numel() * 2 + 3 * lse.numel() * 4
    rows = []
    for name, fn in [("torch", merge_into_reference), ("triton-one-pass", merge_into)]:
        ms = bench_ms(lambda fn=fn: fn(out, lse, new_out, new_lse), rep)
        rows.append({"merge": name, "ms": ms, "GB/s": moved / ms / 1e6})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter timings")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rep = 60 if args.quick else 300
    torch.manual_seed(int(time.time()))
    started = time.time()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "python": platform.python_version(), "sdpa_lse": sdpa_lse_shapes()}
    report["single_chunk"], best = single_chunk(rep)
    report["best_configs"] = {d: asdict(c) for d, c in best.items()}
    triton_attention.DEFAULT_CONFIGS.update(best)
    report["merge"] = merges(rep)
    report["patterns"] = patterns(rep)
    report["seconds"] = time.time() - started
    path = os.path.join(os.environ.get("OUT", "."), "kernels_bench.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)

    print(f"{report['device']} torch {report['torch']} triton {report['triton']}")
    for backend, r in report["sdpa_lse"].items():
        print(f"lse {backend}: {r}")
    print("single chunk (bf16, B=1):")
    for r in report["single_chunk"]:
        print(f"  D={r['head_dim']} L={r['L']} {r['kernel']:<26} {r['ms']:8.3f} ms {r['tflops']:6.1f} TF/s"
              f"  x{r['vs_cudnn']:.3f} of cuDNN")
    print(f"best fused configs: {report['best_configs']}")
    for r in report["merge"]:
        print(f"merge {r['merge']:<16} {r['ms'] * 1e3:7.1f} us {r['GB/s']:6.0f} GB/s")
    print("patterns (one rank of 8; stage = one K/V block with state loaded; layer = all 8 blocks):")
    for r in report["patterns"]:
        print(f"  {r['layer']:<13} {r['method']:<5} {r['kernel']:<5} stage {r['stage_ms']:8.3f} ms "
              f"{r['stage_tflops']:6.1f} TF/s  layer {r['layer_ms']:8.3f} ms {r['layer_tflops']:6.1f} TF/s  "
              f"diff {r['rel_diff_fused_vs_sdpa']:.1e} auto={r['auto_picks_for_stage']}")
    print(f"done in {report['seconds']:.0f} s")


if __name__ == "__main__":
    main()
